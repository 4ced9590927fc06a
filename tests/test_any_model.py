"""Any causal or masked LM through ``model=hf``: the architecture read from its own config, TT shapes derived,
adapter sites from the placement table or found from the module structure, on tiny random configurations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

from adazeta.adapters import ADAPTERS
from adazeta.dryrun import dry_run
from adazeta.errors import ConfigError
from adazeta.models import ModelConfig, architecture_summary, build_meta_model, complete_config, infer_family
from adazeta.build import preflight
from adazeta.settings import parse
from helpers import compose_cfg

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)
GQA = dict(num_key_value_heads=2, head_dim=8)
CONFIGS = {
    "gemma3_text": {**SIZES, **GQA},
    "qwen3": {**SIZES, **GQA},
    # 4 query + 2 x 2 key/value heads of 8: the fused qkv_proj is 32 -> 64, as wide as the MLP's intermediate.
    "phi3": {**SIZES, "num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {**SIZES, **GQA},
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=300, bos_token_id=0, eos_token_id=0),
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=300,
                word_embed_proj_dim=32),
    "bert": SIZES,
    "roberta": SIZES,
    # Configs that leave the MLP's width implicit (BLOOM, GPT-J's n_inner=None) or name one the model does not
    # build (MPT's expansion_ratio: transformers builds 4 x hidden): the width is read off the layers.
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4, vocab_size=300),
    "gptj": dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, vocab_size=300, bos_token_id=0, eos_token_id=0),
    "mpt": dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, vocab_size=300),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=300),
}
# GPT-2, BLOOM, GPT-J and MPT build a 4 x hidden MLP; Falcon's ffn_hidden_size defaults to it
INTERMEDIATE = {"gpt2": 128, "bloom": 128, "gptj": 128, "mpt": 128, "falcon": 128}
FAMILY = {"bert": "masked", "roberta": "masked"}
LLAMA_MLP = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
# TT adapter sites, official placement: the table's (mistral, qwen3, gpt2, opt, bert, roberta) or found from the
# structure (gemma3_text, phi3, bloom, gptj, mpt, falcon: the MLP's input and output projections).
TT_SITES = {
    "gemma3_text": [f"model.layers.{{i}}.{p}" for p in LLAMA_MLP],
    "qwen3": [f"model.layers.{{i}}.{p}" for p in LLAMA_MLP],
    "mistral": [f"model.layers.{{i}}.{p}" for p in LLAMA_MLP],
    "phi3": ["model.layers.{i}.mlp.gate_up_proj", "model.layers.{i}.mlp.down_proj"],
    "gpt2": ["transformer.h.{i}.attn.c_proj", "transformer.h.{i}.mlp.c_proj"],
    "opt": ["model.decoder.layers.{i}.fc1", "model.decoder.layers.{i}.fc2"],
    "bert": ["bert.encoder.layer.{i}.attention.output.dense", "bert.encoder.layer.{i}.output.dense"],
    "roberta": ["roberta.encoder.layer.{i}.attention.output.dense", "roberta.encoder.layer.{i}.output.dense"],
    "bloom": ["transformer.h.{i}.mlp.dense_h_to_4h", "transformer.h.{i}.mlp.dense_4h_to_h"],
    "gptj": ["transformer.h.{i}.mlp.fc_in", "transformer.h.{i}.mlp.fc_out"],
    "mpt": ["transformer.blocks.{i}.ffn.up_proj", "transformer.blocks.{i}.ffn.down_proj"],
    "falcon": ["transformer.h.{i}.mlp.dense_h_to_4h", "transformer.h.{i}.mlp.dense_4h_to_h"],
}
# LoRA: peft's default attention projections; Phi-3, which peft has no default for, gets the MLP's.
LORA_SITES = {
    "gemma3_text": ["model.layers.{i}.self_attn.q_proj", "model.layers.{i}.self_attn.v_proj"],
    "qwen3": ["model.layers.{i}.self_attn.q_proj", "model.layers.{i}.self_attn.v_proj"],
    "mistral": ["model.layers.{i}.self_attn.q_proj", "model.layers.{i}.self_attn.v_proj"],
    "phi3": ["model.layers.{i}.mlp.gate_up_proj", "model.layers.{i}.mlp.down_proj"],
    "gpt2": ["transformer.h.{i}.attn.c_attn"],
    "opt": ["model.decoder.layers.{i}.self_attn.q_proj", "model.decoder.layers.{i}.self_attn.v_proj"],
    "bert": ["bert.encoder.layer.{i}.attention.self.query", "bert.encoder.layer.{i}.attention.self.value"],
    "roberta": ["roberta.encoder.layer.{i}.attention.self.query", "roberta.encoder.layer.{i}.attention.self.value"],
    "bloom": ["transformer.h.{i}.self_attention.query_key_value"],
    "gptj": ["transformer.h.{i}.attn.q_proj", "transformer.h.{i}.attn.v_proj"],
    "mpt": ["transformer.blocks.{i}.attn.Wqkv"],
    "falcon": ["transformer.h.{i}.self_attention.query_key_value"],
}
# Every TT adapter here has width 32, b = 8, r = 2: down modes [2,4,4,2,2,2] (56 core parameters), up modes
# [2,2,2,2,4,4] (52), biases 8 + 32.
TT_PARAMS = 56 + 52 + 8 + 32
# LoRA r = 2 on an (in, out) layer: 2 * (in + out). q 32->32, v 32->16 (2 kv heads of 8), c_attn 32->96,
# Phi-3 gate_up 32->128 and down 64->32, BLOOM's and MPT's fused qkv 32->96, Falcon's multi-query qkv 32->48.
LORA_PARAMS = {"gemma3_text": 2 * 2 * (64 + 48), "qwen3": 2 * 2 * (64 + 48), "mistral": 2 * 2 * (64 + 48),
               "phi3": 2 * 2 * (160 + 96), "gpt2": 2 * 2 * 128, "opt": 2 * 2 * 128, "bert": 2 * 2 * 128,
               "roberta": 2 * 2 * 128, "bloom": 2 * 2 * 128, "gptj": 2 * 2 * 128, "mpt": 2 * 2 * 128,
               "falcon": 2 * 2 * 80}
TT_NAMES = [f"{side}.cores.{k}" for side in ("down", "up") for k in range(6)] + ["down.bias", "up.bias"]
METHOD = ["method=adazeta", "method.adapter.bottleneck=8", "method.adapter.rank=2"]


def sites(table: dict[str, list[str]], model_type: str) -> list[str]:
    return [site.format(i=i) for i in range(2) for site in table[model_type]]


@pytest.fixture
def config_folder(tmp_path: Path):
    """A folder holding only the config.json of a tiny model of the given type: no weights, no tokenizer."""

    def make(model_type: str) -> Path:
        folder = tmp_path / model_type
        AutoConfig.for_model(model_type, **CONFIGS[model_type]).save_pretrained(folder)
        assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
        return folder

    return make


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_architecture_and_family_come_from_the_config(model_type, config_folder):
    cfg = complete_config(ModelConfig(name="t", family=None, path=str(config_folder(model_type))))
    assert cfg.family == FAMILY.get(model_type, "causal")
    assert architecture_summary(cfg) == {
        "model_type": model_type, "hidden_size": 32, "intermediate_size": INTERMEDIATE.get(model_type, 64),
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300,
    }


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_tt_adapters_fit_and_run(model_type, config_folder):
    s = parse(compose_cfg(["model=hf", f"model.path={config_folder(model_type)}", *METHOD]))
    model = ADAPTERS.get("tt").builder(build_meta_model(s.model), s.adapter.config)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == {f"{site}.adapter.{p}" for site in sites(TT_SITES, model_type) for p in TT_NAMES}
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == TT_PARAMS * len(TT_SITES[model_type]) * 2
    # The same wiring on real random weights runs a forward pass.
    auto = AutoModelForCausalLM if s.model.family == "causal" else AutoModelForMaskedLM
    torch.manual_seed(0)
    model = ADAPTERS.get("tt").builder(auto.from_config(AutoConfig.for_model(model_type, **CONFIGS[model_type])),
                                       s.adapter.config).eval()
    logits = model(input_ids=torch.randint(3, 300, (2, 6))).logits
    assert logits.shape == (2, 6, 300) and torch.isfinite(logits).all()


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_lora_fits_and_runs(model_type, config_folder):
    s = parse(compose_cfg(["model=hf", f"model.path={config_folder(model_type)}", "method=mezo_lora",
                           "method.adapter.r=2"]))
    torch.manual_seed(0)
    auto = AutoModelForCausalLM if s.model.family == "causal" else AutoModelForMaskedLM
    model = auto.from_config(AutoConfig.for_model(model_type, **CONFIGS[model_type])).eval()
    model = ADAPTERS.get("lora").builder(model, s.adapter.config)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == {f"base_model.model.{site}.lora_{ab}.default.weight" for site in sites(LORA_SITES, model_type)
                     for ab in "AB"}
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == LORA_PARAMS[model_type]
    logits = model(input_ids=torch.randint(3, 300, (2, 6))).logits
    assert logits.shape == (2, 6, 300) and torch.isfinite(logits).all()


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_dry_run_from_a_folder_holding_only_config_json(model_type, config_folder, capsys):
    s = parse(compose_cfg(["model=hf", f"model.path={config_folder(model_type)}", *METHOD, "dry_run=true"]))
    preflight(s)
    record = dry_run(s)
    assert record["trainable_params"] == TT_PARAMS * len(TT_SITES[model_type]) * 2
    assert record["adapters"] == len(TT_SITES[model_type]) * 2
    assert f"model_type {model_type}, hidden_size 32" in capsys.readouterr().out


def test_found_sites_equal_the_reference_table_on_the_llama_family(reference_targets):
    """Structure and table agree where both apply, so a new Llama-like type gets the reference sites."""
    from adazeta.adapters.sites import find_sites, match_targets

    for model_type in ("llama", "mistral", "qwen3"):
        config = AutoConfig.for_model(model_type, **SIZES, **GQA)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        for placement in ("official", "paper"):
            table = match_targets(model, reference_targets(model_type, placement))
            found = find_sites(model, placement)
            assert list(found) == list(table)  # same sites, same order (the adapters' init draws in that order)
            assert {n: pos for n, (_, pos) in found.items()} == {n: pos for n, (_, pos) in table.items()}


def test_the_config_names_the_mlp_width_where_the_layers_show_two():
    """Gemma-style attention wider than the residual stream (4 heads of 16 on hidden 32: q 32 -> 64, o 64 -> 32)
    pairs like an MLP; the layers then show two widths and the config's intermediate_size decides."""
    from adazeta.adapters.sites import find_sites, mlp_sizes, model_linears, structural_intermediate

    config = AutoConfig.for_model("gemma3_text", **{**SIZES, **GQA, "head_dim": 16, "intermediate_size": 96})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linears = model_linears(model)
    assert structural_intermediate(32, linears) is None
    assert mlp_sizes(config, linears) == (32, 96)
    found = find_sites(model, "official")
    assert list(found) == [f"model.layers.{i}.{p}" for i in range(2) for p in LLAMA_MLP]


def test_a_model_with_no_mlp_width_anywhere_is_refused_in_one_line():
    from adazeta.adapters.sites import mlp_sizes

    config = AutoConfig.for_model("bloom", hidden_size=32, n_layer=2, n_head=4)
    with pytest.raises(ConfigError, match=r"model_type='bloom': neither its config nor its layers .* "
                                          r"set method\.adapter\.targets"):
        mlp_sizes(config, {"attn.qkv": (32, 96), "attn.dense": (32, 32)})
    # A named width the layers contradict (MobileBERT's bottlenecks pair hidden with a narrower width) is not
    # overruled silently either way.
    config = AutoConfig.for_model("bert", **SIZES)
    with pytest.raises(ConfigError, match="names an intermediate size of 64 but its layers pair hidden 32 with 16"):
        mlp_sizes(config, {"in": (32, 16), "mlp.in": (16, 64), "mlp.out": (64, 16), "out": (16, 32)})


def test_albert_gets_the_sites_of_the_one_layer_all_its_depths_share():
    from adazeta.adapters.sites import find_sites

    config = AutoConfig.for_model("albert", **SIZES, embedding_size=16)  # one group of one layer, used twice
    with torch.device("meta"):
        model = AutoModelForMaskedLM.from_config(config)
    layer = "albert.encoder.albert_layer_groups.0.albert_layers.0"
    assert {n: pos for n, (_, pos) in find_sites(model, "official").items()} == {
        f"{layer}.ffn": "input", f"{layer}.ffn_output": "output"}
    assert list(find_sites(model, "paper")) == [f"{layer}.attention.dense", f"{layer}.ffn_output"]


@pytest.mark.parametrize("model_type", ["gemma3_text", "phi3"])
def test_dense_adapters_after_attention_and_mlp_found_from_the_structure(model_type, config_folder):
    s = parse(compose_cfg(["model=hf", f"model.path={config_folder(model_type)}", "method=mezo_adapter"]))
    assert (s.adapter.config.placement, s.adapter.config.targets) == ("paper", None)  # no table entry
    model = ADAPTERS.get("bottleneck").builder(build_meta_model(s.model), s.adapter.config)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == {f"model.layers.{i}.{site}.adapter.{p}.{w}" for i in range(2)
                     for site in ("self_attn.o_proj", "mlp.down_proj") for p in ("down", "up") for w in ("weight", "bias")}


def test_family_follows_the_architectures_field():
    assert infer_family(AutoConfig.for_model("bert", architectures=["BertForMaskedLM"])) == "masked"
    assert infer_family(AutoConfig.for_model("bert", architectures=["BertLMHeadModel"])) == "causal"
    assert infer_family(AutoConfig.for_model("bert")) == "masked"
    assert infer_family(AutoConfig.for_model("gemma3_text")) == "causal"


def test_hf_model_needs_a_source_and_an_existing_path(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.hub_id=<org/name> or model\.path="):
        parse(compose_cfg(["model=hf"]))
    with pytest.raises(ConfigError, match=r"model\.path=.*neither a \.gguf file nor a folder holding config\.json"):
        parse(compose_cfg(["model=hf", f"model.path={tmp_path / 'missing'}"]))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"cannot read the model config of .*broken"):
        parse(compose_cfg(["model=hf", f"model.path={tmp_path / 'broken'}"]))


def test_a_config_only_folder_is_not_enough_to_train(config_folder):
    s = parse(compose_cfg(["model=hf", f"model.path={config_folder('qwen3')}", *METHOD]))
    with pytest.raises(ConfigError, match="has a config.json but no weights"):
        preflight(s)


@pytest.mark.parametrize("model_type, method", [("gemma3_text", "adazeta"), ("qwen3", "mezo_lora"),
                                                ("roberta", "adazeta"), ("bloom", "adazeta")])
def test_a_saved_model_folder_trains_end_to_end_with_no_yaml(model_type, method, tmp_path, fixture_data):
    """model=hf model.path=<save_pretrained folder>: weights and tokenizer from the folder, a few ZO steps, a record."""
    from adazeta.models import byte_tokenizer
    from adazeta.run import run

    tokenizer = byte_tokenizer()
    sizes = {**CONFIGS[model_type], "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    config = AutoConfig.for_model(model_type, **sizes)
    auto = AutoModelForMaskedLM if FAMILY.get(model_type) == "masked" else AutoModelForCausalLM
    torch.manual_seed(0)
    folder = tmp_path / "saved"
    auto.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    task = "sst2" if FAMILY.get(model_type) == "masked" else "rte"
    overrides = ["model=hf", f"model.path={folder}", f"task={task}", f"data.dir={fixture_data}",
                 "data.num_train=32", "data.num_dev=16", "data.num_eval=16", "train.max_steps=4", "train.eval_every=2",
                 "train.batch_size=4", "wandb.mode=disabled", f"method={method}"]
    if method == "adazeta":
        overrides += ["method.adapter.bottleneck=8", "method.adapter.rank=2"]
    record = run(compose_cfg(overrides), tmp_path / "run")
    assert record["status"] == "finished" and record["steps"] == 4
    assert record["model_source"]["kind"] == "local" and record["model_source"]["path"] == str(folder)
    assert record["trainable_params"] > 0 and record["forward_passes"] > 0
    assert 0.0 <= record["test_accuracy"] <= 1.0

"""The dry run's counts: every registered adapter declares what it trains (``count_trainable``) and the adapter
modules it adds (``count_modules``), and the dry run on the meta device reports exactly what the real adapter,
attached to the same tiny random model, trains."""

from __future__ import annotations

import pytest

from adazeta.adapters import ADAPTERS
from adazeta.build import attach_adapter
from adazeta.dryrun import dry_run
from adazeta.models import count_parameters, load_model
from adazeta.settings import parse
from helpers import compose_cfg

# Each registered adapter, by its config group option, with the options that change what trains; both families.
CASES = [
    ("tt", "tiny-llama", []),
    ("tt", "tiny-roberta", ["method.adapter.rank=3", "method.adapter.bottleneck=8"]),
    ("tt", "tiny-llama", ["method.adapter.placement=paper", "method.adapter.targets=null"]),
    ("bottleneck", "tiny-llama", ["method.adapter.bottleneck=8"]),
    ("bottleneck", "tiny-roberta", []),
    ("lora", "tiny-llama", []),
    ("lora", "tiny-llama", ["method.adapter.r=3", "method.adapter.train_head=true",
                            "method.adapter.target_modules=[q_proj,down_proj]"]),
    ("lora", "tiny-roberta", ["method.adapter.train_head=true"]),
    ("full", "tiny-llama", []),
    ("full", "tiny-llama", ["method.adapter.freeze_head=true"]),
    ("full", "tiny-roberta", ["method.adapter.freeze_head=true"]),
    ("none", "tiny-llama", []),
    ("saved", "tiny-llama", []),
]


def settings_for(kind: str, model: str, extra: list[str], saved: str | None = None):
    """The settings of a dry run of ``kind`` on ``model``, its vocabulary the tiny model's own (a random model is
    built for its byte tokenizer), so that the meta model and the loaded one have the same shapes."""
    from adazeta.models import byte_tokenizer

    overrides = ["method=mezo", f"model={model}", f"adapter@method.adapter={kind}", "dry_run=true",
                 f"+model.architecture.vocab_size={len(byte_tokenizer())}", *extra]
    if saved is not None:
        overrides.append(f"method.adapter.source={saved}")
    return parse(compose_cfg(overrides))


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory) -> str:
    """A TT adapter saved from the tiny Llama, as a run saves it (``method=eval`` scores such a folder)."""
    from adazeta.runs.saving import save_adapters

    s = settings_for("tt", "tiny-llama", [])
    model = attach_adapter(s, load_model(s.model, seed=0).model)
    folder = tmp_path_factory.mktemp("run") / "adapter"
    save_adapters(model, folder, "tt", s.adapter.config, {"name": s.model.name, "family": s.model.family})
    return str(folder)


def test_every_registered_adapter_has_a_dry_run_case():
    """A new adapter gets a row in CASES, so its declared count is checked against its real one."""
    assert {kind for kind, _, _ in CASES} == set(ADAPTERS.names())


@pytest.mark.parametrize("kind,model,extra", CASES, ids=[f"{k}-{m}-{len(e)}" for k, m, e in CASES])
def test_the_dry_run_counts_what_the_real_adapter_trains_on_a_tiny_model(kind, model, extra, saved_folder, capsys):
    """The meta-device count, declared by the adapter's config from the bare backbone's shapes, equals the
    trainable parameters of the real adapter attached to the tiny random model (tied weights once); the adapter
    modules it reports are those the real adapter added."""
    s = settings_for(kind, model, extra, saved_folder if kind == "saved" else None)
    record = dry_run(s)
    real = attach_adapter(s, load_model(s.model, seed=0).model)
    assert record["trainable_params"] == count_parameters(real)[1]
    assert record["total_params"] == count_parameters(real)[0]
    assert record["adapters"] == s.adapter.config.count_modules(real)
    assert f"trainable params {record['trainable_params']:,}" in capsys.readouterr().out
    if s.adapter.config.trains:
        assert record["trainable_params"] > 0
    if kind in ("tt", "bottleneck", "lora", "saved"):
        assert record["adapters"] > 0  # a module per site, LoRA's layers and the saved TT adapters included

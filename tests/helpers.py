"""Plain helpers and constants the tests share: paths, markers for the real files, fixture data, Hydra
composition. Tests import them with ``from helpers import ...`` (the tests folder is on sys.path)."""

from __future__ import annotations

import csv
import json
import os
import random
import signal
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import adazeta  # noqa: F401  (registers ${experiment_sweep:}, which experiment configs compose with)
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SHARED = ROOT.parent / "shared"
SHARED_DATA = SHARED / "data"
SHARED_MODELS = SHARED / "models"

needs_shared_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data is not present")
needs_shared_model = pytest.mark.skipif(
    not (SHARED_MODELS / "SmolLM2-135M-Instruct").is_dir(), reason="../shared/models is not present"
)

WORDS = "the a movie film plot actor good bad great terrible fine dull bright story scene music long short".split()


def write_fixture_data(root: Path, n_train: int = 120, n_eval: int = 40, seed: int = 0) -> Path:
    """Small RTE-shaped (JSON lines) and SST-2-shaped (TSV) files in the local layout the task specs expect."""
    rng = random.Random(seed)
    rte = root / "superglue" / "RTE"
    rte.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.jsonl", n_train), ("val.jsonl", n_eval)):
        with open(rte / name, "w") as f:
            for i in range(n):
                premise = " ".join(rng.choices(WORDS, k=rng.randint(5, 12)))
                label = rng.choice(["entailment", "not_entailment"])
                hypothesis = premise.split()[0] + " is here" if label == "entailment" else "nothing"
                f.write(json.dumps({"premise": premise, "hypothesis": hypothesis, "label": label, "idx": i}) + "\n")
    sst = root / "glue" / "SST-2"
    sst.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", 10), ("test.tsv", n_eval)):
        with open(sst / name, "w") as f:
            f.write("sentence\tlabel\n")
            for _ in range(n):
                label = rng.randint(0, 1)
                word = "great" if label else "bad"
                f.write(" ".join(rng.choices(WORDS, k=rng.randint(3, 8)) + [word]) + f"\t{label}\n")
    # Masked LMs read SST-2 in the LM-BFF k-shot layout (16 per class, data seed 13: the data.k/kshot_seed defaults).
    kshot = root / "lm-bff" / "k-shot" / "SST-2" / "16-13"
    kshot.mkdir(parents=True, exist_ok=True)
    for name, per_class in (("train.tsv", 16), ("dev.tsv", 16), ("test.tsv", n_eval // 2)):
        rows = [
            " ".join(rng.choices(WORDS, k=rng.randint(3, 8)) + [word]) + f"\t{label}"
            for label, word in ((0, "bad"), (1, "great"))
            for _ in range(per_class)
        ]
        (kshot / name).write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    return root


TINY_GGUF = "tiny-llama.Q8_0.gguf"


def write_tiny_gguf(folder: Path, seed: int = 0, tie: bool = True) -> Path:
    """A tiny random Llama (tiny-llama's sizes) and the tiny byte-level tokenizer written as one GGUF file, its 2-D
    weights quantised to Q8_0 as llama.cpp's converter writes them (q and k rows permuted for its rotary layout).

    ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` reads it back as transformers reads any GGUF
    file: the legacy loader dequantises it and marks the model quantised with ``gguf``. Returns the file's path."""
    import gguf
    import numpy as np
    import torch
    import transformers

    from adazeta.models import byte_tokenizer

    tokenizer = byte_tokenizer()
    # transformers' GGUF byte-level tokenizer adds <|endoftext|> unless the vocabulary has it: give it a row.
    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])] + ["<|endoftext|>"]
    heads, kv_heads, hidden, layers = 4, 2, 32, 2
    config = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=1024, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / TINY_GGUF
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_block_count(layers)
    writer.add_context_length(1024)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(64)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("<") and t.endswith(">") and len(t) > 2
                            else gguf.TokenType.NORMAL for t in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)

    def permute(w: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for name, tensor in model.state_dict().items():
        if tie and name == "lm_head.weight":
            continue
        w = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            w = permute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = permute(w, kv_heads)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if w.ndim == 2:
            q8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(target, q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(target, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_overrides(data_dir: Path, gguf_path: Path, *extra: str) -> list[str]:
    """``tiny_overrides`` on a GGUF file (``model=hf model.path=<file>.gguf``), not tiny-llama's in-memory model."""
    return [*tiny_overrides(data_dir, *extra)[1:], "model=hf", f"model.path={gguf_path}", "model.name=tiny-gguf"]


def compose_cfg(overrides: list[str]) -> DictConfig:
    """The config `adazeta-run` would build from these command-line overrides."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=False)


def tiny_overrides(data_dir: Path, *extra: str) -> list[str]:
    """A few-second run on tiny-llama with fixture data, no wandb."""
    return [
        "model=tiny-llama",
        "task=rte",
        f"data.dir={data_dir}",
        "data.num_train=32",
        "data.num_dev=16",
        "data.num_eval=16",
        "train.max_steps=4",
        "train.eval_every=2",
        "train.batch_size=4",
        "wandb.mode=disabled",
        *extra,
    ]


# Columns that measure the machine, not the computation: they differ between any two runs.
TIMING = {"step_time_s", "peak_mem_mb"}


def rows(path: Path, drop: set[str] = frozenset()) -> list[dict[str, str]]:
    """A CSV's rows, without the columns in ``drop``."""
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if k not in drop} for r in csv.DictReader(f)]


def signal_at_step(monkeypatch, step: int, signum: int = signal.SIGTERM, times: int = 1) -> None:
    """Send ``signum`` (``times`` times in a row) to this process right after the loop has logged ``step``, inside
    that step (a real signal, real handler)."""
    from adazeta.tracking import Tracker

    log_step = Tracker.log_step

    def log_and_signal(self, row):
        log_step(self, row)
        if row["step"] == step:
            for _ in range(times):
                os.kill(os.getpid(), signum)

    monkeypatch.setattr(Tracker, "log_step", log_and_signal)


STUDY_ORDER = ["cpu_zo", "cpu_zo_claims", "cpu_zo_speed", "cpu_zo_optimizers", "cpu_zo_optimizers_recentred",
               "cpu_zo_optimizers_lora_recentred", "grad_fidelity"]


def study_pages() -> str:
    """The studies' pages (studies/<name>/README.md) one after the other: what the tests hold to the reports."""
    root = Path(__file__).resolve().parents[1] / "studies"
    return "\n".join((root / name / "README.md").read_text() for name in STUDY_ORDER)


def study_script(name: str):
    """A study's own report module (studies/<name>/report.py), imported from its file: it is not in the package."""
    import importlib.util

    path = ROOT / "studies" / name / "report.py"
    spec = importlib.util.spec_from_file_location(f"study_{name}_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

"""Keep what a run trains, in formats the ecosystem loads, and load it back onto a plain ``transformers`` model.

A run writes ``adapter/`` (the best-dev state that test was evaluated with; ``adapter_last/`` too with
``train.save=last|both``):

- LoRA: peft's own folder (``adapter_config.json``, ``adapter_model.safetensors``), so
  ``PeftModel.from_pretrained(base, run_dir / "adapter")`` loads it; a head trained beside it (``train_head``) is
  in ``head.safetensors``, which ``load_adapters`` applies too.
- TT and bottleneck adapters (not mergeable: a nonlinearity sits between their factors):
  ``adapter_model.safetensors`` (the adapters' parameters under their module names) and ``adazeta_adapter.json``
  (the adapter kind and its whole config, the base model and the architecture it was trained on);
  ``load_adapters(model, folder)`` attaches them to a plain model and loads the tensors, refusing a base model
  that does not match in one line.
- Full-parameter methods (MeZO, Sparse-MeZO, FT): ``train.save_model=true`` writes the model's own
  ``save_pretrained`` folder to ``model/`` (one copy of the model: its size is logged first).

Every folder has a ``README.md`` model card (``model_card``): Hub metadata, task, method, scores, the command, a GGUF
base named with its quantisation, and loading lines that run as written; peft's own card for LoRA is merged into,
and peft's adapter config names the base by its Hub id (or file name), never by a local path. ``save_pretrained`` on a model with
TT or bottleneck adapters attached is refused (it would store the adapted layers under renamed keys, which
``from_pretrained`` silently replaces by random weights): save the adapters with ``save_adapters``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adazeta.errors import ConfigError
from adazeta.tasks.family import family as as_family

log = logging.getLogger("adazeta")

ADAPTER_CONFIG = "adazeta_adapter.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
HEAD_WEIGHTS = "head.safetensors"
FORMAT = 1
# The architecture values a saved adapter must find again in the model it is loaded onto.
ARCHITECTURE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")


def architecture_of(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    return {k: getattr(config, k, None) for k in ARCHITECTURE_KEYS}


def is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def trainable_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save_adapters(model: nn.Module, folder: Path, kind: str, config: Any, base: dict[str, Any],
                  card: str = "", state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the trained adapters of ``model`` (or ``state``, a trainable state of it) to ``folder``.

    ``kind`` and ``config``: the adapter registry's name and config dataclass; ``base``: what names the base model
    (name, hub id or path). ``state`` (e.g. the best-dev state kept in memory) is loaded into the model first."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if state is not None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
    if is_peft(model):
        model.save_pretrained(str(folder))
        config_path = folder / "adapter_config.json"  # peft records the loaded model's (local) path
        peft_config = json.loads(config_path.read_text())
        peft_config["base_model_name_or_path"] = base_reference(base)
        config_path.write_text(json.dumps(peft_config, indent=2, sort_keys=True) + "\n")
        head = {n: t for n, t in trainable_tensors(model).items() if "lora_" not in n}
        if head:  # train_head: peft saves the LoRA matrices only
            save_file(head, str(folder / HEAD_WEIGHTS))
    else:
        tensors = trainable_tensors(model)
        if not tensors:
            raise ConfigError(f"method's adapter {kind!r} trains nothing to save; set train.save=none")
        save_file(tensors, str(folder / ADAPTER_WEIGHTS))
        meta = {"format": FORMAT, "kind": kind, "config": dataclasses.asdict(config), "base_model": base,
                "architecture": architecture_of(model),
                "tensors": {n: list(t.shape) for n, t in tensors.items()}}
        (folder / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=1, default=str) + "\n")
    if card:
        write_card(folder, card)
    return folder


def check_saved(folder: str | Path) -> None:
    """Before any model loads: the saved adapters' JSON files parse and their safetensors files are whole (the
    header parses and the file holds every byte it lists). ConfigError naming the file and the way out."""
    folder = Path(folder)
    fix = "restore the folder from a copy, or train the run again (force=true)"
    for name in (ADAPTER_CONFIG, "adapter_config.json"):
        path = folder / name
        if path.is_file():
            try:
                if not isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as err:
                raise ConfigError(f"{path} is damaged ({type(err).__name__}: {str(err).splitlines()[0][:120]}); "
                                  f"{fix}") from None
    for name in (ADAPTER_WEIGHTS, HEAD_WEIGHTS):
        path = folder / name
        if name == ADAPTER_WEIGHTS and not path.is_file():
            raise ConfigError(f"{folder} holds no {ADAPTER_WEIGHTS}, the adapters' weights; {fix}")
        problem = _safetensors_problem(path) if path.is_file() else None
        if problem:
            raise ConfigError(f"{path} is damaged ({problem}); {fix}")


def _safetensors_problem(path: Path) -> str | None:
    """What makes ``path`` not a whole safetensors file (8-byte header length, JSON header, the data it lists)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 2 or 8 + length > size:
                return f"{size:,} bytes: too short for its header"
            header = json.loads(f.read(length))
    except (OSError, ValueError) as err:
        return f"its header does not parse: {type(err).__name__}"
    ends = [entry["data_offsets"][1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets", ())) == 2]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        return f"truncated: {size:,} of its {needed:,} bytes"
    return None


def load_adapters(model: nn.Module, folder: str | Path) -> nn.Module:
    """Attach the adapters saved in ``folder`` to ``model`` (a plain ``transformers`` model) and load their weights.

    Returns the model to use: the same module with TT / bottleneck adapters, or peft's ``PeftModel`` for LoRA.
    A folder that holds no adapters, or a base model whose architecture or layers differ from the one the adapters
    were trained on, is one line (``ConfigError``)."""
    from safetensors.torch import load_file

    from adazeta.adapters import ADAPTERS
    from adazeta.registry import make_config

    folder = Path(folder)
    check_saved(folder)
    if (folder / "adapter_config.json").is_file():  # peft's LoRA folder
        from peft import PeftModel

        try:
            wrapped = PeftModel.from_pretrained(model, str(folder))
        except Exception as err:  # a base model without the adapted modules, or other shapes
            from adazeta.models import first_line

            raise ConfigError(f"cannot load the LoRA adapters of {folder} onto this model ({first_line(err)}); load "
                              "them onto the base model they were trained on, with the adapter_config.json saved "
                              "with them") from None
        if (folder / HEAD_WEIGHTS).is_file():
            load_into(wrapped, load_file(str(folder / HEAD_WEIGHTS)), folder / HEAD_WEIGHTS, untie=True)
        return wrapped
    meta_path = folder / ADAPTER_CONFIG
    if not meta_path.is_file():
        raise ConfigError(f"{folder} holds no saved adapters ({ADAPTER_CONFIG} or peft's adapter_config.json); "
                          "point at a run's adapter/ folder")
    meta = json.loads(meta_path.read_text())
    mine, theirs = architecture_of(model), meta.get("architecture", {})
    # A dry run's meta-device model (counts, memory): its vocabulary is the config's, not a tokenizer's, and it
    # holds no numbers to load.
    dry = any(p.is_meta for p in model.parameters())
    keys = [k for k in ARCHITECTURE_KEYS if not (dry and k == "vocab_size")]
    differ = [f"{k} {theirs.get(k)} -> {mine.get(k)}" for k in keys if theirs.get(k) != mine.get(k)]
    if differ:
        base = meta.get("base_model", {}).get("name", "?")
        raise ConfigError(f"the adapters in {folder} were trained on {base!r}, another architecture than this model's "
                          f"({'; '.join(differ)}); load them onto that model")
    _warn_other_name(model, meta.get("base_model") or {}, folder)
    entry = ADAPTERS.get(meta["kind"])
    model = entry.builder(model, make_config(entry.config_cls, meta["config"], where=f"{meta_path} config"))
    if not dry:
        load_into(model, load_file(str(folder / ADAPTER_WEIGHTS)), folder / ADAPTER_WEIGHTS)
    return model


def load_adapter_state_(model: nn.Module, folder: str | Path) -> nn.Module:
    """Load the adapter tensors ``save_adapters`` wrote to ``folder`` into ``model``, which already carries those TT
    or bottleneck adapters (a Trainer checkpoint: resumed, or the best one reloaded). A tensor this model lacks, or
    of another shape, is one line. Returns ``model``."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ConfigError(f"{folder} holds no {ADAPTER_WEIGHTS}; point at a checkpoint that ZOTrainer saved")
    load_into(model, load_file(str(path)), path)
    return model


def _warn_other_name(model: nn.Module, base: dict[str, Any], folder: Path) -> None:
    """The same architecture under another name (another fine-tune of it, or a local copy under another path):
    loaded, with a warning naming both, since a copy's path legitimately differs from its Hub id."""
    mine = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    theirs = [str(v) for k, v in base.items() if k in ("hub_id", "path", "gguf_file") and v]
    if mine and theirs and not any(Path(t).name in mine or Path(mine).name in t for t in theirs):
        log.warning("the adapters in %s were trained on %s; this model is %s (same architecture): loading them",
                    folder, " / ".join(theirs), mine)


def load_into(model: nn.Module, tensors: dict[str, torch.Tensor], where: Path, untie: bool = False) -> None:
    params = dict(model.named_parameters())
    for name, value in tensors.items():
        target = params.get(name)
        if target is None or tuple(target.shape) != tuple(value.shape):
            found = "no such parameter" if target is None else f"shape {tuple(target.shape)}, saved {tuple(value.shape)}"
            raise ConfigError(f"{where}: {name}: {found} in this model; load it onto the base model it was trained on")
    if untie:  # a trained head is its own copy, not the embedding's
        from adazeta.adapters.basic import untie_head

        untie_head(model)
        params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value.to(params[name].dtype))


def refuse_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` refuse in one line while TT or bottleneck adapters are attached."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConfigError("save_pretrained would store this model's adapted layers under renamed keys (from_pretrained "
                          "then initialises them at random); save the adapters with adazeta.save_adapters (a run "
                          "writes them to adapter/) and load them with adazeta.load_adapters(model, folder)")

    model.save_pretrained = refuse  # an instance attribute: the class and unadapted models are untouched


def base_reference(base: dict[str, Any]) -> str | None:
    """How a saved adapter names its base model: the Hub id, else the file or folder name. Never an absolute local
    path: it means nothing on another machine and tells of this one."""
    if base.get("hub_id"):
        return str(base["hub_id"])
    where = base.get("gguf_file") or base.get("path")
    return Path(str(where)).name if where else base.get("name")


@functools.lru_cache(maxsize=8)
def gguf_quantisation(path: str) -> str:
    """The quantisation a GGUF file stores its weights in (its ``general.file_type``: Q4_1, Q8_0, F16, ...)."""
    import gguf

    try:
        field = gguf.GGUFReader(path).fields["general.file_type"]
        return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")
    except Exception:  # no such key, or a file type this gguf release does not name
        return "of unknown type"


def model_card(record: dict[str, Any], command: list[str] | None, kind: str, base: dict[str, Any],
               folder: Path, whole_model: bool = False) -> str:
    """README.md for a saved adapter folder: Hub metadata, what was trained on what base weights (a GGUF file's,
    dequantised, when the run loaded one), how well, the command, and loading lines that run as written."""
    from huggingface_hub import ModelCardData

    metric = record.get("metric") or "accuracy"
    source = record.get("model_source") or {}
    family = as_family(base.get("family") or "causal")  # a record from before model.family
    masked, auto = family.reads_mask, family.auto_class
    where = source.get("path") if source.get("kind") in ("local", "hub") else base.get("hub_id")
    gguf_file = source.get("gguf_file")
    data = ModelCardData(
        library_name="peft" if kind == "lora" else "adazeta", base_model=base.get("hub_id") or None,
        pipeline_tag="fill-mask" if masked else "text-generation",
        tags=["adazeta", "zeroth-order", f"method:{record.get('method')}", f"task:{record.get('task')}", kind]
        + (["gguf"] if gguf_file else []))
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {record.get('method')} on {record.get('task')} ({record.get('model')})", "",
        f"Trained by adazeta (`{kind}` adapters), seed {record.get('seed')}, status {record.get('status')}, "
        f"{record.get('steps')} steps, kept state from step {record.get('best_step')}.", "",
    ]
    if gguf_file:
        quant = gguf_quantisation(str(Path(where) / gguf_file)) if source.get("kind") == "local" else "of unknown type"
        original = f" of {base['hub_id']}" if base.get("hub_id") else ""
        lines += [f"The base weights were read from the GGUF file `{gguf_file}` ({quant} quantisation), which "
                  "transformers dequantises to float: the adapters were trained on those weights, not on the "
                  f"original ones{original}; load the same file for the same numbers.", ""]
    lines += [
        "| split | loss | " + metric + " |",
        "|---|---|---|",
        f"| dev | {record.get('dev_loss')} | {record.get('dev_' + metric)} |",
        f"| test | {record.get('test_loss')} | {record.get('test_' + metric)} |",
        "",
        "Command: `adazeta-run " + " ".join(command or []) + "`",
        "",
    ]
    if where is None and not whole_model:
        return "\n".join(lines + ["The base model had random weights (`model.random_init`): no file holds it, so "
                                   "only the run's own code can rebuild it (`method=eval eval.from=<run dir>`).", ""])
    dtype = ', torch_dtype="bfloat16"' if base.get("dtype") == "bf16" else ""
    here = str(Path(folder).resolve())
    if whole_model:  # a full-parameter run's save_pretrained folder: the trained model itself
        code = [f"from transformers import {auto}", "", f"MODEL = {here!r}  # this folder",
                f"model = {auto}.from_pretrained(MODEL{dtype})"]
    else:
        code = [f"from transformers import {auto}", "import adazeta", "",
                f"BASE = {str(where)!r}  # the base model: a Hub id or the folder it was read from"]
        if gguf_file:
            code.append(f"GGUF = {gguf_file!r}  # the GGUF file in BASE the adapters were trained on")
        code += [f"ADAPTER = {here!r}  # this folder",
                 f"base = {auto}.from_pretrained(BASE{', gguf_file=GGUF' if gguf_file else ''}{dtype})",
                 "model = adazeta.load_adapters(base, ADAPTER)"]
    lines += ["Load it:" if whole_model else "Load it onto the base model:", "", "```python", *code, "```", ""]
    return "\n".join(lines)


def write_card(folder: Path, card: str) -> None:
    """``card`` as ``folder``'s README.md; a card already there (peft's, for LoRA) is merged into, not replaced: its
    metadata joins ours (tags together; our base model, never its local path) and its text follows ours."""
    from huggingface_hub import ModelCard

    path = folder / "README.md"
    ours = ModelCard(card)
    if path.is_file():
        theirs = ModelCard.load(path)
        merged = {**theirs.data.to_dict(), **ours.data.to_dict()}
        # peft's base_model:adapter:<path> tag names the loaded model's path too; the Hub derives it from base_model
        kept = {t for t in theirs.data.tags or [] if not t.startswith("base_model:")}
        merged["tags"] = sorted(kept | set(ours.data.tags or []))
        if ours.data.base_model is None:
            merged.pop("base_model", None)  # peft's is the loaded model's path
        ours = ModelCard(f"---\n{type(ours.data)(**merged).to_yaml()}\n---\n{ours.text}\n{theirs.text}")
    path.write_text(str(ours))

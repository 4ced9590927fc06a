"""Export a run's trained model as a standard ``save_pretrained`` folder, offline.

    python -m adazeta.export <run dir> <out folder>

- LoRA runs: the adapters are merged into the base weights (peft's ``merge_and_unload``): ``out`` is a plain model
  that ``AutoModelForCausalLM.from_pretrained(out)`` loads, with the tokenizer beside it.
- TT and bottleneck adapters are not mergeable (a nonlinearity sits between their factors): ``out`` holds the base
  model (``save_pretrained``), the tokenizer, the adapters in ``out/adapter`` and a README with the two lines that
  load them (``adazeta.load_adapters``).
- Full-parameter runs saved with ``train.save_model=true``: their ``model/`` folder is already the export.
The base model is the one the run's config names (its ``model.path``, the local model folder, or the Hub id).
Publishing stays the user's: ``huggingface-cli upload <repo> <out>``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from adazeta.errors import ConfigError

LOADING = """# {title}

Exported by `python -m adazeta.export` from `{run}`. The adapters are not mergeable into the base weights (a
nonlinearity sits between their factors), so this folder holds the base model and the adapters beside it:

```python
from transformers import {auto}, AutoTokenizer
import adazeta
model = adazeta.load_adapters({auto}.from_pretrained("{out}"), "{out}/adapter")
tokenizer = AutoTokenizer.from_pretrained("{out}")
```

Publish with `huggingface-cli upload <repo> {out}`.
"""


def export(run_dir: Path, out: Path) -> str:
    """Write the export of ``run_dir`` to ``out``; returns what was written, in a few words."""
    from adazeta.models import load_model
    from adazeta.saving import ADAPTER_CONFIG, load_adapters
    from adazeta.settings import parse

    run_dir, out = Path(run_dir), Path(out)
    record_path = run_dir / "result.json"
    if not record_path.is_file():
        raise ConfigError(f"{run_dir} holds no result.json; point at a finished run directory")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; choose a new folder")
    if (run_dir / "model").is_dir():
        shutil.copytree(run_dir / "model", out, dirs_exist_ok=True)
        return f"the trained model ({run_dir / 'model'}) copied to {out}"
    adapter = run_dir / "adapter"
    if not adapter.is_dir():
        raise ConfigError(f"{run_dir} kept no trained state (no adapter/ or model/): it ran with train.save=none, "
                          "or it is a full-parameter run without train.save_model=true")
    config = json.loads(record_path.read_text()).get("config")
    if not config:
        raise ConfigError(f"{record_path} records no config; it cannot name its base model")
    s = parse(OmegaConf.create(config))
    loaded = load_model(s.model, seed=s.seed)
    model = load_adapters(loaded.model, adapter)
    out.mkdir(parents=True, exist_ok=True)
    if not (adapter / ADAPTER_CONFIG).is_file():  # peft LoRA: merged into the base weights
        merged = model.merge_and_unload()
        merged.save_pretrained(str(out))
        loaded.tokenizer.save_pretrained(str(out))
        return f"LoRA merged into {s.model.name}'s weights: {out} (from_pretrained loads it)"
    loaded_plain = load_model(s.model, seed=s.seed)  # the base model again, without adapters, to save as is
    loaded_plain.model.save_pretrained(str(out))
    loaded_plain.tokenizer.save_pretrained(str(out))
    shutil.copytree(adapter, out / "adapter")
    auto = "AutoModelForMaskedLM" if s.model.family == "masked" else "AutoModelForCausalLM"
    (out / "README.md").write_text(LOADING.format(title=f"{s.method} on {s.task.name} ({s.model.name})", run=run_dir,
                                                  auto=auto, out=out))
    return f"{s.model.name} with its {s.adapter.kind} adapters beside it: {out} (README.md: how to load)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m adazeta.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        print(export(args.run_dir, args.out))
    except ConfigError as err:
        print(f"adazeta.export: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

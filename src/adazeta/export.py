"""Export a run's trained model as a standard ``save_pretrained`` folder, offline.

    python -m adazeta.export <run dir> <out folder>

- LoRA runs: the adapters are merged into the base weights (peft's ``merge_and_unload``): ``out`` is a plain model
  that ``AutoModelForCausalLM.from_pretrained(out)`` loads, with the tokenizer and a README beside it.
- TT and bottleneck adapters are not mergeable (a nonlinearity sits between their factors): ``out`` holds the base
  model (``save_pretrained``), the tokenizer, the adapters in ``out/adapter`` and a README with the two lines that
  load them (``adazeta.load_adapters``).
- Full-parameter runs saved with ``train.save_model=true``: their ``model/`` folder is already the export.
The base model is the one the run's config names (its ``model.path``, the local model folder, or the Hub id). A base
read from a GGUF file is written as the float weights transformers dequantised it to (its README says so). The
export is written beside ``out`` and renamed into place when complete: a failure leaves no half-written folder.
Publishing stays the user's: ``huggingface-cli upload <repo> <out>``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from adazeta.errors import ConfigError
from adazeta.tasks.family import family as as_family

LOADING = """# {title}

Exported by `python -m adazeta.export` from `{run}`. The adapters are not mergeable into the base weights (a
nonlinearity sits between their factors), so this folder holds the base model and the adapters beside it:

```python
from transformers import {auto}, AutoTokenizer
import adazeta
model = adazeta.load_adapters({auto}.from_pretrained("{out}"), "{out}/adapter")
tokenizer = AutoTokenizer.from_pretrained("{out}")
```
{gguf}
Publish with `huggingface-cli upload <repo> {out}`.
"""

MERGED = """# {title}

Exported by `python -m adazeta.export` from `{run}`: the LoRA adapters merged into the base weights (peft's
`merge_and_unload`), a plain model:

```python
from transformers import {auto}, AutoTokenizer
model = {auto}.from_pretrained("{out}")
tokenizer = AutoTokenizer.from_pretrained("{out}")
```
{gguf}
Publish with `huggingface-cli upload <repo> {out}`.
"""

GGUF_NOTE = """
The base weights were read from the GGUF file `{file}` ({quant} quantisation), which transformers dequantises to
float: they are saved here as ordinary float weights, so this folder loads without that file or the `gguf` package,
and gives the numbers the run had on that file (not those of the original unquantised model).
"""


def export(run_dir: Path, out: Path) -> str:
    """Write the export of ``run_dir`` to ``out``; returns what was written, in a few words.

    Everything is written to a hidden sibling folder first and renamed to ``out`` once complete: a failure leaves
    no ``out`` (or the empty one that was there), never a half-written one."""
    from adazeta.runs.saving import check_saved

    run_dir, out = Path(run_dir), Path(out)
    record_path = run_dir / "result.json"
    if not record_path.is_file():
        raise ConfigError(f"{run_dir} holds no result.json; point at a finished run directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; choose a new folder")
    whole = run_dir / "model"
    if not whole.is_dir() and not (run_dir / "adapter").is_dir():
        raise ConfigError(f"{run_dir} kept no trained state (no adapter/ or model/): it ran with train.save=none, "
                          "or it is a full-parameter run without train.save_model=true")
    if not whole.is_dir():
        check_saved(run_dir / "adapter")  # before the base model loads
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        if whole.is_dir():
            shutil.copytree(whole, partial, dirs_exist_ok=True)
            said = f"the trained model ({whole}) copied to {out}"
        else:
            said = _export_adapters(run_dir, record_path, partial, out)
        if out.exists():
            out.rmdir()  # empty (checked above): the complete folder takes its place
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return said


def _export_adapters(run_dir: Path, record_path: Path, folder: Path, out: Path) -> str:
    """Write the export of a run that kept adapters into ``folder``, which will be renamed to ``out``."""
    from adazeta.models import load_model
    from adazeta.runs.saving import ADAPTER_CONFIG, gguf_quantisation, load_adapters
    from adazeta.settings import parse

    adapter = run_dir / "adapter"
    try:
        config = json.loads(record_path.read_text()).get("config")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{record_path} is damaged ({type(err).__name__}); restore it from a copy") from None
    if not config:
        raise ConfigError(f"{record_path} records no config; it cannot name its base model")
    s = parse(OmegaConf.create(config))
    loaded = load_model(s.model, seed=s.seed)
    source = loaded.source
    gguf = ""
    if source.gguf_file:  # provenance: the weights written here are the file's, dequantised
        quant = gguf_quantisation(str(Path(source.path) / source.gguf_file))
        gguf = GGUF_NOTE.format(file=source.gguf_file, quant=quant)
    auto = as_family(s.model.family).auto_class
    title = f"{s.method} on {s.task.name} ({s.model.name})"
    if not (adapter / ADAPTER_CONFIG).is_file():  # peft LoRA: merged into the base weights
        merged = load_adapters(loaded.model, adapter).merge_and_unload()
        merged.save_pretrained(str(folder))
        loaded.tokenizer.save_pretrained(str(folder))
        (folder / "README.md").write_text(MERGED.format(title=title, run=run_dir, auto=auto, out=out, gguf=gguf))
        return f"LoRA merged into {s.model.name}'s weights: {out} (from_pretrained loads it)"
    loaded.model.save_pretrained(str(folder))  # the base as loaded, before the adapters attach (and refuse saving)
    loaded.tokenizer.save_pretrained(str(folder))
    load_adapters(loaded.model, adapter)  # they fit this base (one line if not), as the README's lines will load them
    shutil.copytree(adapter, folder / "adapter")
    (folder / "README.md").write_text(LOADING.format(title=title, run=run_dir, auto=auto, out=out, gguf=gguf))
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

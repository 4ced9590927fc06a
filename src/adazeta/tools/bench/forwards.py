"""The inference forward (section ``forward``): the plain model, the model with AdaZeta's TT adapters and the AdaZeta
reference trainer's ``zo_forward`` on it; the adapters' overhead in pairs of forwards (folded and unfolded
products, SST-2 and RTE prompts); and the adapters' own time, alone and in place."""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from adazeta.adapters import tt
from adazeta.adapters.tt import TTAdapter
from adazeta.scoring import Encoded, Scorer
from adazeta.tools.bench.common import Report, Setup, Stats, bench_items, timed
from adazeta.tracking import sync

REFERENCE_ROW = "reference zo_forward (TT adapters; a row per candidate, padded to x8, full-vocabulary log-softmax)"


def measure_forwards(args: argparse.Namespace, report: Report, setup: Setup, plain: Scorer, batch: Any
                     ) -> dict[str, Any]:
    """The forwards of ``batch``: ``plain`` (the plain backbone's scorer, packed and in the rows layout), ``setup``'s
    adapted model and the reference computation on it; then the adapters' overhead and their own time. Returns the
    batch's description (the .json's ``batch``), which it also prints."""
    adapted, device, tok = setup.scorer, setup.device, setup.tokenizer
    rows_batch = adapted.collate(setup.items, layout="rows")
    info = {
        "prompt_tokens": [len(e.prompt) for e in setup.items],
        "packed_rows_x_width": list(batch.input_ids.shape),
        "rows_layout_rows_x_width": list(rows_batch.input_ids.shape),
        "reference_layout_sequences": sum(len(e.candidates) for e in setup.items),
    }
    print(f"batch: {len(setup.items)} prompts, {sum(info['prompt_tokens'])} tokens (mean "
          f"{statistics.mean(info['prompt_tokens']):.1f}, max {max(info['prompt_tokens'])}); packed "
          f"{info['packed_rows_x_width']}, rows layout {info['rows_layout_rows_x_width']}", file=sys.stderr)
    r, w = args.repeats, args.warmup
    info["trainable_params"] = setup.built.trainable_params
    forwards = {
        "plain, packed": lambda: plain.loss(batch),
        "plain, rows layout": lambda: plain.loss(rows_batch),
        "TT adapters, packed": lambda: adapted.loss(batch),
    }
    if not args.skip_reference:
        forwards[REFERENCE_ROW] = functools.partial(
            reference_zo_forward, adapted.model, setup.items, tok.pad_token_id, device)
    with torch.inference_mode():
        fwd = timed(forwards, device, r, w)
    for name, stats in fwd.items():
        report.add("forward", "inference forward", name, stats, "s")
    # The overhead is a few % of a forward, below the drift between rounds: pairs of forwards, ratio per pair;
    # and in the same rounds the adapters' unfolded products (``tt.unfolded()``: the same numbers), to show the gain.
    def unfolded() -> Any:
        with tt.unfolded():
            return forwards["TT adapters, packed"]()

    with torch.inference_mode():
        pairs = timed({"plain": forwards["plain, packed"], "adapted": forwards["TT adapters, packed"],
                       "unfolded": unfolded}, device, max(args.overhead_pairs, r), w)
    overhead = pairs["adapted"].over(pairs["plain"])
    tokens = sum(info["prompt_tokens"])
    report.add("forward", "TT adapters' forward overhead",
               f"SST-2 prompts, {tokens} tokens; adapted / plain - 1, {overhead.runs} pairs",
               Stats.of([x - 1 for x in overhead.samples]), "x")
    report.add("forward", "TT adapters' forward overhead, unfolded products",
               f"SST-2 prompts, {tokens} tokens; the same rounds",
               Stats.of([x - 1 for x in pairs["unfolded"].over(pairs["plain"]).samples]), "x")
    report.add("forward", "TT adapters' forward, folded / unfolded products", f"SST-2 prompts, {tokens} tokens; "
               "the same rounds", pairs["adapted"].over(pairs["unfolded"]), "x")
    if args.overhead_long_pairs:
        # The adapters' cost has a part per call (90 of them on SmolLM2) besides its part per token: over a
        # forward of longer prompts (RTE's) that part weighs less.
        long_items = bench_items(args, setup.settings, adapted, "rte", args.batch_size)
        long_batch = adapted.collate(long_items)
        with torch.inference_mode():
            long = timed({"plain": lambda: plain.loss(long_batch), "adapted": lambda: adapted.loss(long_batch)},
                         device, args.overhead_long_pairs, min(w, 1))
        ratio = long["adapted"].over(long["plain"])
        report.add("forward", "TT adapters' forward overhead",
                   f"RTE prompts, {sum(len(e.prompt) for e in long_items)} tokens; adapted / plain - 1, "
                   f"{ratio.runs} pairs", Stats.of([x - 1 for x in ratio.samples]), "x")
    measure_adapters_alone(args, report, adapted, batch, pairs["plain"])
    return info


def reference_zo_forward(model: torch.nn.Module, items: list[Encoded], pad_id: int, device: torch.device) -> Any:
    """What the AdaZeta reference trainer's ``zo_forward`` computes for one loss (MeZO's large-model code, which
    it builds on: ``forward_wrap_with_option_len`` with ``train_as_classification``): one sequence per (prompt,
    candidate), right-padded to the longest rounded up to a multiple of 8 (its collator's ``pad_to_multiple_of``),
    the model's logits at every position and over the whole vocabulary, the shifted logits copied
    (``.contiguous()``), a full log-softmax, the candidate tokens' mean log-probability per sequence, and the
    cross-entropy over candidates. Run on the adapted model, it is the reference's loss forward."""
    rows, option_len = [], []
    for ex in items:
        for cand in ex.candidates:
            rows.append(ex.prompt + cand)
            option_len.append(len(cand))
    width = -(-max(map(len, rows)) // 8) * 8
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask).logits
    shift_logits = logits[..., :-1, :].contiguous()
    labels = ids[..., 1:].clone()
    labels[mask[..., 1:] == 0] = -100
    for r, n in enumerate(option_len):  # only the candidate's tokens count
        end = int(mask[r].sum()) - 1
        labels[r, : end - n] = -100
    log_probs = F.log_softmax(shift_logits, dim=-1)
    keep = labels != -100
    picked = torch.gather(log_probs, -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_row = (picked * keep).sum(-1) / keep.sum(-1)
    n_options = len(items[0].candidates)
    gold = torch.tensor([e.gold for e in items], device=device)
    return F.cross_entropy(per_row.view(-1, n_options).float(), gold)


def measure_adapters_alone(args: argparse.Namespace, report: Report, scorer: Scorer, batch: Any,
                           plain: Stats) -> None:
    """The TT adapters' own time in a forward, two ways, against the plain forward's time: alone (every adapter
    run on the input it saw in one adapted forward of ``batch``, one after another) and in place (hooks around
    every adapter inside adapted forwards, their times summed per forward). Inside a forward each adapter runs
    after the backbone's large products, cold, so in place takes longer than alone; the pairs' ratio holds both
    and the rest of the adapted forward."""
    adapters = [m for m in scorer.model.modules() if isinstance(m, TTAdapter)]
    if not adapters:
        return
    inputs: dict[nn.Module, torch.Tensor] = {}
    hooks = [adapter.register_forward_pre_hook(lambda m, args: inputs.setdefault(m, args[0].detach().clone()))
             for adapter in adapters]
    try:
        with torch.inference_mode():
            scorer.loss(batch)
    finally:
        for hook in hooks:
            hook.remove()
    captured = [(a, inputs[a]) for a in adapters if a in inputs]

    def run_all() -> None:
        for adapter, x in captured:
            adapter(x)

    with torch.inference_mode():
        alone = timed({"alone": run_all}, batch.input_ids.device, max(args.overhead_pairs, args.repeats),
                      args.warmup)["alone"]
    setting = f"{len(captured)} adapters on their inputs of one forward"
    report.add("forward", "TT adapters alone", setting, alone, "s")
    report.add("forward", "TT adapters alone / plain forward", setting,
               Stats.of([x / plain.median for x in alone.samples]), "x")

    device = batch.input_ids.device
    spent, started = [0.0], {}

    def before(module: nn.Module, _: Any) -> None:
        sync(device)
        started[module] = time.perf_counter()

    def after(module: nn.Module, _: Any, __: Any) -> None:
        sync(device)
        spent[0] += time.perf_counter() - started.pop(module)

    hooks = [h for a in adapters for h in (a.register_forward_pre_hook(before), a.register_forward_hook(after))]
    in_place = []
    try:
        with torch.inference_mode():
            for i in range(args.warmup + max(args.repeats, 5)):
                spent[0] = 0.0
                scorer.loss(batch)
                if i >= args.warmup:
                    in_place.append(spent[0])
    finally:
        for hook in hooks:
            hook.remove()
    setting = f"{len(captured)} adapters inside adapted forwards (hooks around each)"
    report.add("forward", "TT adapters in place", setting, Stats.of(in_place), "s")
    report.add("forward", "TT adapters in place / plain forward", setting,
               Stats.of([x / plain.median for x in in_place]), "x")

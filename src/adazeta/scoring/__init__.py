"""Candidate scoring: tokenise examples, pack them into batches, and score every candidate in one forward.

Over 400 lines: encoding, packing and scoring are one contract: the scorer reads the layout the packer wrote.

Causal LMs (the MeZO protocol): a candidate's score is the mean log-probability of its tokens given the
prompt. The training loss is the cross-entropy over the candidates' scores. Masked LMs (LM-BFF): the score of a
label word is its logit at the mask position; the loss is the cross-entropy over the label words.

Savings over scoring one full sequence per candidate, none of which changes a number (tests/test_scoring.py):
- the candidates of an example share its prompt, computed once. In the ``packed`` layout (causal LMs) an example
  is one *unit*: its prompt, then each candidate's tokens but the last (the last is only predicted). A block
  attention mask lets a candidate's tokens see the prompt and their own candidate's earlier tokens, nothing
  else, and their position ids continue from the prompt's end, so each candidate sees exactly what it would see
  as a sequence of its own. One-token candidates add no tokens at all: all are read at the prompt's last position;
- units share rows (first fit, no row longer than the longest unit), so short prompts are not padded to the
  longest one of the batch;
- the vocabulary projection (and its log-softmax) runs only at the positions that are scored.

The ``rows`` layout (one right-padded row per example, or per candidate when a candidate is longer than one
token, and a plain padding mask) serves masked LMs and any model that cannot take a custom 4D attention mask
with position ids (``packing_supported``); a packed batch falls back to it on its own.

The package's other modules score through ``Scorer``: ``evaluate`` (batched evaluation), ``generation`` (greedy
generation for the generation tasks) and ``calibration`` (calibrated zero-shot and ICL scores).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from adazeta.errors import ConfigError
from adazeta.tasks.family import CAUSAL, Family
from adazeta.tasks.family import family as as_family
from adazeta.tasks.objectives import Objective
from adazeta.tasks.spec import Example

LAYOUTS = ("packed", "rows")

# Architectures whose forward in transformers 5.x takes a 4D attention mask as given together with explicit
# position ids (checked against the plain computation in tests/test_scoring.py). Others use the rows layout.
PACKED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "opt", "gpt2", "gpt_neox", "phi")
# Attention kernels that honour an arbitrary mask; flash-attention kernels only know causal + padding masks.
PACKED_ATTENTION = ("sdpa", "eager")


@dataclass
class Encoded:
    """One example as token ids: the prompt, each candidate's continuation, the gold index."""

    prompt: list[int]
    candidates: list[list[int]]
    gold: int
    truncated: bool = False  # the prompt was cut to fit model.max_length

    @property
    def shared_prompt(self) -> bool:
        """True when every candidate is one token, so that all are read at the prompt's last position."""
        return all(len(c) == 1 for c in self.candidates)

    def num_tokens(self) -> int:
        """Tokens of the packed unit: the prompt once, then every candidate's tokens but its last."""
        return len(self.prompt) + sum(len(c) - 1 for c in self.candidates)


@dataclass
class Batch:
    """Packed rows plus the flat index of every scored token. Lives on one device."""

    input_ids: torch.Tensor  # (rows, T)
    attention_mask: torch.Tensor  # (rows, T) 1 on tokens, 0 on padding
    # (P,) flat index row * T + t of each hidden state that predicts a scored token, each listed once: the
    # candidates of a shared prompt are all read at its last position, which is projected to the vocabulary once.
    positions: torch.Tensor
    token_position: torch.Tensor  # (N,) for each scored token, its row in ``positions``
    targets: torch.Tensor  # (N,) the scored token ids
    token_candidate: torch.Tensor  # (N,) flat candidate index of each scored token
    candidate_length: torch.Tensor  # (C,) tokens per candidate (float, for the mean)
    candidate_slot: torch.Tensor  # (C,) example * max_candidates + j
    gold: torch.Tensor  # (B,)
    max_candidates: int
    # Packed layout only (None in the rows layout):
    position_ids: torch.Tensor | None = None  # (rows, T) position of each token within its own example
    unit: torch.Tensor | None = None  # (rows, T) index of the example a token belongs to; -1 on padding
    branch: torch.Tensor | None = None  # (rows, T) 0 on prompt tokens, j + 1 on candidate j's tokens
    # Host-side copy of the examples, to lay them out again in rows for a model that cannot take packing.
    items: tuple[Encoded, ...] | None = None
    pad_id: int = 0
    mask_id: int | None = None
    # Each example's position in the split it came from (``Scorer.batches``), so per-example predictions of a
    # length-sorted evaluation are written back in the split's order; None for a training minibatch.
    index: tuple[int, ...] | None = None

    @property
    def num_examples(self) -> int:
        return int(self.gold.shape[0])

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device) -> "Batch":
        moved = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        return Batch(**moved)

    def repeat(self, n: int) -> "Batch":
        """The batch ``n`` times over, copy-major (rows of copy r first): one forward for n weight replicas.

        Scores come out as (n * B, max_candidates), copy r's examples at rows r * B to (r + 1) * B - 1.
        """
        if n == 1:
            return self
        rows, width = self.input_ids.shape
        dev = self.device

        def shifted(index: torch.Tensor, step: int) -> torch.Tensor:
            offsets = torch.arange(n, device=dev).repeat_interleave(index.numel()) * step
            return index.repeat(n) + offsets

        def tiled(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.repeat(n, 1)

        return dataclasses.replace(
            self,
            input_ids=tiled(self.input_ids),
            attention_mask=tiled(self.attention_mask),
            positions=shifted(self.positions, rows * width),
            token_position=shifted(self.token_position, self.positions.numel()),
            targets=self.targets.repeat(n),
            token_candidate=shifted(self.token_candidate, self.candidate_length.numel()),
            candidate_length=self.candidate_length.repeat(n),
            candidate_slot=shifted(self.candidate_slot, self.num_examples * self.max_candidates),
            gold=self.gold.repeat(n),
            position_ids=tiled(self.position_ids),
            unit=tiled(self.unit),
            branch=tiled(self.branch),
            items=None if self.items is None else self.items * n,
        )

    def as_rows(self) -> "Batch":
        """The same examples in the rows layout (for models without packing support), on the same device."""
        if not self.packed:
            return self
        if self.items is None:
            raise ValueError("this packed batch keeps no examples to lay out in rows; collate it again")
        return collate(self.items, CAUSAL, self.pad_id, self.mask_id, layout="rows").to(self.device)  # packs: causal


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _encode_masked_body(tokenizer: Any, ex: Example) -> tuple[list[int], bool]:
    """A masked prompt's ids without special tokens, as LM-BFF builds them, and whether a sentence was cut.

    LM-BFF's ``tokenize_multipart_input`` encodes each part of a template on its own and concatenates the ids;
    a one-character literal (``?``, ``,``, ``.``, ``:``) is looked up as a token, and a sentence keeps at most
    ``first_sent_limit`` (the first) or ``other_sent_limit`` (the others) tokens. Encoding the joined text in one
    piece differs where a part boundary is not a word boundary: the premise ``"... known as "`` before ``"?"``
    gives ``" ?"`` as one token. A prompt that is not its parts' concatenation (demonstrations were prepended)
    encodes the extra head in one piece, then the parts.
    """
    parts = ex.meta.get("parts")
    text = "".join(parts) if parts else ""
    if not parts or not ex.prompt.endswith(text):
        return _encode_text(tokenizer, ex.prompt), False
    head = ex.prompt[: len(ex.prompt) - len(text)]
    ids = _encode_text(tokenizer, head) if head else []
    limits = ex.meta.get("limits") or {}
    sentences = ex.meta.get("sentences", [])
    unk, cut = getattr(tokenizer, "unk_token_id", None), False
    for i, part in enumerate(parts):
        if part == tokenizer.mask_token:
            ids.append(tokenizer.mask_token_id)
            continue
        if len(part) == 1 and i not in sentences:
            token = tokenizer.convert_tokens_to_ids(part)
            if token is not None and token != unk:
                ids.append(token)
                continue
        piece = _encode_text(tokenizer, part)
        if i in sentences:
            limit = limits.get("first_sent_limit" if i == sentences[0] else "other_sent_limit")
            if limit is not None and len(piece) > limit:
                piece, cut = piece[:limit], True
        ids += piece
    return ids, cut


def _with_special_tokens(tokenizer: Any, text: str, body: list[int]) -> list[int]:
    """``body`` between the special tokens the tokenizer adds around ``text`` (``<s>``/``</s>``, ``[CLS]``/``[SEP]``)."""
    full = tokenizer(text, add_special_tokens=True, truncation=False)["input_ids"]
    plain = _encode_text(tokenizer, text)
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
    if start is None:  # a tokenizer whose special tokens change the text's own ids: keep its encoding
        return full
    return full[:start] + body + full[start + len(plain) :]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def split_joint(tokenizer: Any, prompt: str, candidates: Sequence[str]) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, each candidate's ids), the candidates' ids taken from the tokenisation of prompt + candidate.

    MeZO tokenises the whole verbalised string and scores its tail. Tokenising a candidate on its own can differ:
    a SentencePiece tokenizer (Llama-2, Gemma) puts its word-start marker and prefix space before a lone ``Yes``
    or `` great``, which inside the joint string is ``Yes`` after a newline or one ``▁great`` token. The shared
    prompt is the longest head that the prompt's own tokenisation and every joint tokenisation have in common,
    so each candidate, read after it, is exactly its joint string. Usually that head is the whole prompt. When
    the joint tokenisation merges across the boundary (a trailing space that joins the candidate's first word,
    as after ReCoRD's ``- ``), the merged tokens belong to the candidate, as MeZO, which strips the prompt's
    trailing spaces, scores them.
    """
    head, *joint = tokenizer([prompt] + [prompt + c for c in candidates], add_special_tokens=False)["input_ids"]
    shared = min([len(head)] + [_common_prefix(head, j) for j in joint])
    for cand, ids in zip(candidates, joint):
        if len(ids) <= shared:
            raise ConfigError(f"candidate {cand!r} adds no token to its prompt; every candidate needs text to score")
    return head[:shared], [ids[shared:] for ids in joint]


def _truncate_causal(prompt: list[int], longest: int, bos: list[int], max_length: int) -> list[int]:
    """The prompt's last tokens that fit before the longest candidate, after the BOS token (MeZO's left cut)."""
    if longest >= max_length:
        raise ConfigError(f"a candidate of {longest} tokens does not fit model.max_length={max_length}")
    room = max_length - len(bos) - longest
    return bos + prompt[max(len(prompt) - room, 0) :]


def _truncate_masked(ids: list[int], body: list[int], mask_id: int, max_length: int) -> list[int]:
    """``max_length`` tokens of a masked prompt, the mask always among them.

    LM-BFF keeps the first ``max_length`` tokens (its default; the reference scripts never set
    ``truncate_head``) and stops if the mask is not among them. Here that tail cut is taken whenever the mask
    survives it; otherwise (a long sentence before the mask: SST-2's before "It was<mask>.", an NLI premise) the
    text on each side of the mask loses tokens from its far end, the longer side first, and the special tokens
    (``<s>``, ``</s>``) and the template words around the mask stay. ``ids`` is ``body``, the text's tokens,
    between the special tokens the tokenizer adds.
    """
    if mask_id in ids[:max_length]:
        return ids[:max_length]
    start = next(i for i in range(len(ids) - len(body) + 1) if ids[i : i + len(body)] == body)
    end = start + len(body)
    at = ids.index(mask_id, start)
    left, right = at - start, end - at - 1
    keep = left + right - (len(ids) - max_length)
    keep_right = min(right, max(keep - left, keep // 2))
    keep_left = keep - keep_right
    return ids[:start] + ids[at - keep_left : at + 1 + keep_right] + ids[end:]


def encode(examples: Sequence[Example], tokenizer: Any, family: Family | str, max_length: int) -> list[Encoded]:
    """Token ids of each example: the shared prompt, the candidates' continuations, whether the prompt was cut.

    Causal LMs: candidates as MeZO tokenises them (:func:`split_joint`); a prompt too long for ``max_length`` with
    its longest candidate keeps its BOS token and its last tokens (MeZO's left truncation, which keeps the
    question and the candidates whole; MeZO cuts each candidate's sequence on its own, so a shorter candidate
    sees the context of the longest one here). Masked LMs: the template's parts encoded and limited as LM-BFF
    does (:func:`_encode_masked_body`), within the model's special tokens, cut to the smaller of ``max_length``
    and the template's own ``max_length`` (:func:`_truncate_masked`); label words are one token each, as in
    LM-BFF. ``truncated`` counts any cut: a sentence limit or the prompt's length.
    """
    out, family = [], as_family(family)
    bos = [tokenizer.bos_token_id] if family.starts_with_bos and getattr(tokenizer, "add_bos_token", False) else []
    for ex in examples:
        if family.reads_mask:
            body, cut = _encode_masked_body(tokenizer, ex)
            prompt = _with_special_tokens(tokenizer, ex.prompt, body)
            limit = (ex.meta.get("limits") or {}).get("max_length")
            length = max_length if limit is None else min(limit, max_length)
            cands = []
            for word in ex.candidates:
                ids = _encode_text(tokenizer, " " + word.strip())
                if len(ids) != 1:
                    raise ConfigError(f"label word {word!r} is {len(ids)} tokens for this tokenizer; masked scoring needs one")
                cands.append(ids)
            truncated = cut or len(prompt) > length
            if len(prompt) > length:
                prompt = _truncate_masked(prompt, body, tokenizer.mask_token_id, length)
        else:
            prompt, cands = split_joint(tokenizer, ex.prompt, ex.candidates)
            longest = max(len(c) for c in cands)
            truncated = len(bos) + len(prompt) + longest > max_length
            prompt = _truncate_causal(prompt, longest, bos, max_length) if truncated else bos + prompt
        out.append(Encoded(prompt, cands, ex.gold, truncated))
    return out


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to at most ``capacity`` (first fit, longest first; deterministic)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


@dataclass
class _Plan:
    """Rows of token ids being laid out and, per candidate token, the (row, t) of the hidden state predicting it."""

    max_c: int
    rows: list[list[int]] = dataclasses.field(default_factory=list)
    # packed layout only: (position ids, unit, branch) per row
    extra: list[tuple[list[int], list[int], list[int]]] = dataclasses.field(default_factory=list)
    scored: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)  # (row, t, token, candidate)
    cand_len: list[int] = dataclasses.field(default_factory=list)
    cand_slot: list[int] = dataclasses.field(default_factory=list)

    def add_candidate(self, i: int, j: int, cand: list[int], at: list[tuple[int, int]]) -> None:
        c = len(self.cand_len)
        self.scored.extend((r, t, tok, c) for (r, t), tok in zip(at, cand))
        self.cand_len.append(len(cand))
        self.cand_slot.append(i * self.max_c + j)


def _plan_packed(items: Sequence[Encoded], plan: _Plan) -> None:
    """Causal LMs, packed: examples share rows (first fit), each candidate a branch after its prompt."""
    placed: dict[int, tuple[int, int]] = {}  # example -> (row, start)
    for members in first_fit([e.num_tokens() for e in items], max(e.num_tokens() for e in items)):
        ids: list[int] = []
        pos: list[int] = []
        unit: list[int] = []
        branch: list[int] = []
        for i in members:
            ex = items[i]
            placed[i] = (len(plan.rows), len(ids))
            p = len(ex.prompt)
            ids += ex.prompt
            pos += range(p)
            branch += [0] * p
            for j, cand in enumerate(ex.candidates):
                ids += cand[:-1]
                pos += range(p, p + len(cand) - 1)
                branch += [j + 1] * (len(cand) - 1)
            unit += [i] * (len(ids) - len(unit))
        plan.rows.append(ids)
        plan.extra.append((pos, unit, branch))
    for i, ex in enumerate(items):  # example order, so that candidate indices do not depend on the packing
        r, start = placed[i]
        last_prompt = start + len(ex.prompt) - 1
        offset = start + len(ex.prompt)
        for j, cand in enumerate(ex.candidates):
            # Token 0 is predicted at the prompt's last position, token k at candidate token k - 1.
            at = [(r, last_prompt)] + [(r, offset + k) for k in range(len(cand) - 1)]
            plan.add_candidate(i, j, cand, at)
            offset += len(cand) - 1


def _plan_rows(items: Sequence[Encoded], family: Family, mask_id: int | None, plan: _Plan) -> None:
    """A row per example (masked LMs, shared prompts) or per example and candidate."""
    for i, ex in enumerate(items):
        if family.reads_mask or ex.shared_prompt:
            r = len(plan.rows)
            plan.rows.append(ex.prompt)
            at = ex.prompt.index(mask_id) if family.reads_mask else len(ex.prompt) - 1
            for j, cand in enumerate(ex.candidates):
                plan.add_candidate(i, j, cand, [(r, at)])
        else:
            for j, cand in enumerate(ex.candidates):
                r = len(plan.rows)
                plan.rows.append(ex.prompt + cand)
                plan.add_candidate(i, j, cand, [(r, len(ex.prompt) + k - 1) for k in range(len(cand))])


def _right_padded(rows: list[list[int]], width: int, fill: int) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for r, ids in enumerate(rows):
        out[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def collate(
    items: Sequence[Encoded], family: Family | str, pad_id: int, mask_id: int | None = None, layout: str = "packed"
) -> Batch:
    """Lay examples out in right-padded rows and record which hidden state scores which candidate token.

    ``layout``: ``packed`` (causal LMs; masked LMs always use rows) or ``rows``; see the module docstring.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; known: {', '.join(LAYOUTS)}")
    plan = _Plan(max_c=max(len(e.candidates) for e in items))
    family = as_family(family)
    if family.packs and layout == "packed":
        _plan_packed(items, plan)
    else:
        _plan_rows(items, family, mask_id, plan)
    rows, scored = plan.rows, plan.scored
    width = max(len(r) for r in rows)
    input_ids = _right_padded(rows, width, pad_id)
    attention_mask = _right_padded([[1] * len(r) for r in rows], width, 0)
    packed: dict[str, Any] = {}
    if plan.extra:
        packed = dict(position_ids=_right_padded([e[0] for e in plan.extra], width, 0),
                      unit=_right_padded([e[1] for e in plan.extra], width, -1),
                      branch=_right_padded([e[2] for e in plan.extra], width, 0), items=tuple(items))
    read: dict[int, int] = {}  # flat position -> its row in `positions`, in first-read order
    token_position = [read.setdefault(r * width + t, len(read)) for r, t, _, _ in scored]
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        positions=torch.tensor(list(read), dtype=torch.long),
        token_position=torch.tensor(token_position, dtype=torch.long),
        targets=torch.tensor([tok for _, _, tok, _ in scored], dtype=torch.long),
        token_candidate=torch.tensor([c for _, _, _, c in scored], dtype=torch.long),
        candidate_length=torch.tensor(plan.cand_len, dtype=torch.float32),
        candidate_slot=torch.tensor(plan.cand_slot, dtype=torch.long),
        gold=torch.tensor([e.gold for e in items], dtype=torch.long),
        max_candidates=plan.max_c,
        pad_id=pad_id,
        mask_id=mask_id,
        **packed,
    )


def lm_parts(model: nn.Module, family: Family | str) -> tuple[nn.Module, nn.Module]:
    """(backbone, head): hidden states from the backbone, vocabulary logits from the head at chosen positions."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the model
    if not as_family(family).reads_mask:  # the decoder's hidden states, its output embeddings
        decoder = base.get_decoder()
        if decoder is base:  # transformers 4.x: a model whose decoder is not `.model` (GPT-2, GPT-NeoX) returns itself
            decoder = base.base_model
        return decoder, base.get_output_embeddings()
    head = getattr(base, "lm_head", None) or getattr(base, "cls", None)
    if head is None:
        raise ConfigError(f"{type(base).__name__} has no MLM head (lm_head or cls); use a *ForMaskedLM model")
    return base.base_model, head


def packing_supported(model: nn.Module, max_position: int = 0) -> bool:
    """Whether ``model`` scores the packed layout exactly: a known architecture, a mask-honouring attention
    kernel, and no sliding window shorter than the packed positions (our mask replaces the window's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "model_type", None) not in PACKED_MODEL_TYPES:
        return False
    if getattr(config, "_attn_implementation", None) not in PACKED_ATTENTION:
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or max_position < window


def block_attention_mask(batch: Batch, attention: str, dtype: torch.dtype) -> torch.Tensor:
    """(rows, 1, T, T) mask of the packed layout: a token sees the earlier tokens of its own example's prompt
    and of its own candidate. Boolean (True = attend) for sdpa; additive (0 / dtype min) for eager attention."""
    unit, branch = batch.unit, batch.branch
    width = unit.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=unit.device).tril_()
    same_unit = (unit[:, :, None] == unit[:, None, :]) & (unit[:, None, :] >= 0)
    same_branch = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    # Padding queries see themselves, so that no softmax row is empty (their outputs are never read).
    allowed = (same_unit & same_branch & causal) | torch.eye(width, dtype=torch.bool, device=unit.device)
    if attention == "sdpa":
        return allowed[:, None]
    additive = torch.zeros(allowed.shape, dtype=dtype, device=unit.device)
    return additive.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def backbone_kwargs(family: Family | str) -> dict[str, bool]:
    """What a scoring forward passes the backbone besides its inputs: a decoder is told not to cache. Left to its
    config's ``use_cache``, it keeps every layer's keys and values until the forward ends (without autograd they are
    otherwise freed layer by layer), and a compiled decoder guards on the cache, recompiling per layer."""
    return {} if as_family(family).reads_mask else {"use_cache": False}


def _hidden_states(model: nn.Module, batch: Batch, family: Family) -> tuple[torch.Tensor, nn.Module]:
    backbone, head = lm_parts(model, family)
    no_cache = backbone_kwargs(family)
    if not batch.packed:
        out = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **no_cache)
        return out.last_hidden_state, head
    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    dtype = backbone.get_input_embeddings().weight.dtype
    mask = block_attention_mask(batch, config._attn_implementation, dtype)
    out = backbone(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids, **no_cache)
    return out.last_hidden_state, head


def candidate_scores(model: nn.Module, batch: Batch, family: Family | str) -> torch.Tensor:
    """(B, max_candidates) scores: mean token log-likelihood (causal) or label-word logit (masked); -inf pads."""
    if batch.packed and not packing_supported(model, batch.input_ids.shape[1]):
        batch = batch.as_rows()
    family = as_family(family)
    hidden, head = _hidden_states(model, batch, family)
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.positions)
    logits = head(picked).float()  # the vocabulary projection, once per scored position
    if not family.reads_mask:  # a candidate's tokens: log-likelihoods (a label word: its logit)
        logits = torch.log_softmax(logits, dim=-1)
    token_scores = logits[batch.token_position, batch.targets]
    num_c = batch.candidate_length.shape[0]
    sums = torch.zeros(num_c, device=logits.device).index_add_(0, batch.token_candidate, token_scores)
    means = sums / batch.candidate_length
    flat = torch.full((batch.num_examples * batch.max_candidates,), float("-inf"), device=logits.device)
    flat = flat.scatter(0, batch.candidate_slot, means)
    return flat.view(batch.num_examples, batch.max_candidates)


def classification_loss(scores: torch.Tensor, gold: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over candidates (MeZO and LM-BFF protocols), the training objective of every method."""
    return F.cross_entropy(scores, gold, reduction=reduction)


def lm_loss(scores: torch.Tensor, gold: torch.Tensor, reduction: str = "mean",
            lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Language-model loss of the gold candidate: minus its mean token log-likelihood (COPA, ReCoRD, SQuAD).

    ``lengths`` (the gold candidates' token counts, ``gold_lengths``): the mean is over all gold tokens of the batch
    (MeZO's large_models/utils.py: one CrossEntropyLoss over every option token), not over examples; ``sum`` is
    then the token-weighted sum, which ``evaluate`` divides by the split's total gold tokens.
    """
    nll = -scores.gather(1, gold[:, None]).squeeze(1)
    if lengths is not None and reduction != "none":
        weighted = (nll * lengths).sum()
        return weighted if reduction == "sum" else weighted / lengths.sum()
    return nll if reduction == "none" else nll.sum() if reduction == "sum" else nll.mean()


def gold_lengths(batch: Batch) -> torch.Tensor:
    """(B,) token count of each example's gold candidate."""
    lengths = torch.zeros(batch.num_examples * batch.max_candidates, dtype=batch.candidate_length.dtype,
                          device=batch.candidate_length.device)
    lengths[batch.candidate_slot] = batch.candidate_length
    return lengths.view(batch.num_examples, batch.max_candidates).gather(1, batch.gold[:, None]).squeeze(1)


def objective_loss(
    scores: torch.Tensor, gold: torch.Tensor, objective: str = "classification", reduction: str = "mean",
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The task's loss (``TaskSpec.objective``): candidate cross-entropy, or the gold's LM loss (lm, generation),
    averaged over gold tokens when ``lengths`` is given."""
    if objective == "classification":
        return classification_loss(scores, gold, reduction)
    return lm_loss(scores, gold, reduction, lengths)


def batch_loss(model: nn.Module, batch: Batch, family: Family | str, objective: str = "classification",
               token_weighted: bool = False) -> torch.Tensor:
    lengths = gold_lengths(batch) if token_weighted and objective != "classification" else None
    return objective_loss(candidate_scores(model, batch, family), batch.gold, objective, lengths=lengths)


def replica_losses(
    model: nn.Module, batch: Batch, family: Family | str, replicas: int, objective: str = "classification",
    token_weighted: bool = False,
) -> torch.Tensor:
    """(replicas,) training losses from one forward over ``replicas`` copies of ``batch`` (``Batch.repeat``).

    With per-replica weights installed in the model (``adazeta.optim.batched``), copy r's loss is the loss at
    replica r's weights: the batched ZO estimator's objective. With one replica it is ``batch_loss``.
    """
    if replicas == 1:
        return batch_loss(model, batch, family, objective, token_weighted).reshape(1)
    scores = candidate_scores(model, batch.repeat(replicas), family)
    per_example = objective_loss(scores, batch.gold.repeat(replicas), objective, reduction="none")
    if token_weighted and objective != "classification":
        lengths = gold_lengths(batch)
        return (per_example.view(replicas, batch.num_examples) * lengths).sum(dim=1) / lengths.sum()
    return per_example.view(replicas, batch.num_examples).mean(dim=1)


@dataclass
class Scorer:
    """How a run scores examples: its model and what encoding, collating and scoring need besides it.

    The one scoring API outside this module: built once from the loaded model (``Scorer.of``, or
    ``adazeta.build.Built.scorer``), it is what the training loop, evaluation, first-order steps and the tools take
    instead of the model, tokenizer, family, pad / mask ids, device and objective, so that no caller names a
    family again. The module's functions (``encode``, ``collate``, ``candidate_scores``, ...) are its parts.
    """

    model: nn.Module
    family: Family = CAUSAL  # a name (causal, masked) is resolved to its Family
    pad_id: int = 0
    mask_id: int | None = None  # masked LMs: the mask token the label word is read at
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    # The task's objective (``adazeta.tasks.objectives.Objective``): classification by default.
    objective: Objective = dataclasses.field(default_factory=Objective)
    # (C,) added to every example's candidate scores: a calibration of a training-free method (adazeta.scoring.calibration)
    bias: torch.Tensor | None = None
    tokenizer: Any = None  # what ``encode`` tokenises with; None for a scorer of already encoded examples

    @classmethod
    def of(cls, model: nn.Module, tokenizer: Any, family: Family | str = CAUSAL, device: torch.device | str = "cpu",
           objective: Objective | None = None) -> "Scorer":
        return cls(model, family, tokenizer.pad_token_id, getattr(tokenizer, "mask_token_id", None),
                   torch.device(device), objective or Objective(), tokenizer=tokenizer)

    def __post_init__(self) -> None:
        self.family = as_family(self.family)  # chosen once: a name becomes its Family here

    def encode(self, examples: Sequence[Example], max_length: int) -> list[Encoded]:
        """Token ids of ``examples`` as this family scores them, cut to ``max_length`` (``encode``)."""
        if self.tokenizer is None:
            raise ValueError("this scorer has no tokenizer to encode with; build it with Scorer.of(model, tokenizer)")
        return encode(examples, self.tokenizer, self.family, max_length)

    def collate(self, items: Sequence[Encoded], layout: str = "packed") -> Batch:
        """``items`` as one batch on the model's device; ``layout``: packed or rows (masked LMs always use rows)."""
        return collate(items, self.family, self.pad_id, self.mask_id, layout).to(self.device)

    def batches(self, encoded: Sequence[Encoded], batch_size: int, sort: bool = False) -> list[Batch]:
        """All of ``encoded`` in batches of ``batch_size`` on the model's device (``sort``: for evaluation)."""
        order = sorted(range(len(encoded)), key=lambda i: encoded[i].num_tokens()) if sort else range(len(encoded))
        order = list(order)
        out = []
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = self.collate([encoded[i] for i in chunk])
            batch.index = tuple(chunk)
            out.append(batch)
        return out

    def parts(self) -> tuple[nn.Module, nn.Module]:
        """(backbone, head) of the model (``lm_parts``): hidden states, then vocabulary logits where scored."""
        return lm_parts(self.model, self.family)

    def scores(self, batch: Batch) -> torch.Tensor:
        """(B, max_candidates) candidate scores (``candidate_scores``), plus the calibration ``bias`` if any."""
        scores = candidate_scores(self.model, batch, self.family)
        if self.bias is not None:
            scores = scores + self.bias[: scores.shape[1]].to(scores.dtype)
        return scores

    def loss(self, batch: Batch) -> torch.Tensor:
        """The task's training loss on ``batch``."""
        return batch_loss(self.model, batch, self.family, self.objective.kind, self.objective.token_weighted)

    def replica_losses(self, batch: Batch, replicas: int) -> torch.Tensor:
        """(replicas,) losses of one forward over ``replicas`` copies of ``batch`` (``replica_losses``)."""
        return replica_losses(self.model, batch, self.family, replicas, self.objective.kind,
                              self.objective.token_weighted)

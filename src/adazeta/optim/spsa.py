"""Pure pieces of the SPSA / MeZO (Malladi et al. 2023) zeroth-order estimator with Q queries.

Over 400 lines: the estimator's pieces and noise streams must draw z in one order; that order has one home.

    g = (1/Q) * sum_q [L(w + eps z_q) - L(w - eps z_q)] / (2 eps) * z_q,     z_q ~ N(0, I)
    w <- w - lr * (g + weight_decay * w)

z is never stored across steps: each query keeps a seed and a scalar (its projected gradient), and z_q is
regenerated from the seed, in a fixed order, whenever it is needed; within a step, a small trainable set (adapters)
keeps each z_q from its first draw to the update (``DirectionCache``). The noise comes from local
``torch.Generator``s so that it never touches (or is touched by) the global RNG, dropout or data order, and is
drawn and applied a chunk of parameters at a time with multi-tensor (``torch._foreach_*``) ops. How a seed
becomes z is the noise stream (``NOISE_STREAMS``): ``per_tensor`` (one generator call per parameter, the
default and the stream of earlier releases), ``flat`` (one call per 4 M entries of each device and dtype) or
``blocks`` (1 M entries per call, each call with a generator of its own: on a CPU they run on several threads).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

_SEED_MASK = (1 << 63) - 1  # torch.Generator.manual_seed takes any 64-bit value; 63 bits stay a positive int64


def query_seed(run_seed: int, step: int, query: int) -> int:
    """Seed of query q at step k: a hash of (run seed, k, q), so no two queries or ranks share a direction."""
    if run_seed < 0 or step < 0 or query < 0:
        raise ValueError(f"query_seed needs non-negative ints, got run_seed={run_seed}, step={step}, query={query}")
    # SeedSequence mixes its whole entropy tuple, so nearby triples give unrelated seeds (unlike seed + step).
    state = np.random.SeedSequence([run_seed, step, query]).generate_state(1, dtype=np.uint64)
    return int(state[0]) & _SEED_MASK


def mask_seed(run_seed: int, step: int) -> int:
    """Seed of step k's random sparsity mask: a stream of its own, so it never repeats a query's seed."""
    if run_seed < 0 or step < 0:
        raise ValueError(f"mask_seed needs non-negative ints, got run_seed={run_seed}, step={step}")
    state = np.random.SeedSequence([run_seed, step], spawn_key=(1,)).generate_state(1, dtype=np.uint64)
    return int(state[0]) & _SEED_MASK


def subspace_seed(run_seed: int, window: int) -> int:
    """Seed of the subspace a structured ZO optimizer keeps for a window of steps (LOZO's V, ZO-Muon's P), window
    k = step // step_interval: a stream of its own (spawn key 3), so it never repeats a query's or a mask's seed,
    and a function of (run seed, k) alone, so a resumed run redraws the same subspace without checkpointing it."""
    if run_seed < 0 or window < 0:
        raise ValueError(f"subspace_seed needs non-negative ints, got run_seed={run_seed}, window={window}")
    state = np.random.SeedSequence([run_seed, window], spawn_key=(3,)).generate_state(1, dtype=np.uint64)
    return int(state[0]) & _SEED_MASK


def block_seed(seed: int, block: int) -> int:
    """Seed of the ``blocks`` stream's generator for its ``block``-th call from ``seed``: a hash of both."""
    state = np.random.SeedSequence([seed, block], spawn_key=(2,)).generate_state(1, dtype=np.uint64)
    return int(state[0]) & _SEED_MASK


class Streams:
    """Local generators seeded from one seed, one per device, created in the order devices are first met.

    Parameters split over several devices get one stream each; later devices derive their seed so that their
    draws do not repeat the first device's. The ``blocks`` stream instead gives each call a generator of its own.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            n = len(self._generators)
            seed = self.seed if n == 0 else query_seed(self.seed, 0, n)
            gen = self._generators[device] = torch.Generator(device=device).manual_seed(seed)
        return gen

    def of_block(self, block: "_Block") -> torch.Generator:
        """The ``blocks`` stream's generator for ``block``, seeded from (seed, the block's place in the layout)."""
        return torch.Generator(device=block.device).manual_seed(block_seed(self.seed, block.ordinal))

    def drawing(self, block: "_Block", stream: str) -> torch.Generator:
        """The generator that draws ``block`` in ``stream``: its own (``blocks``), else its device's stream."""
        return self.of_block(block) if stream == "blocks" else self.on(block.device)


class RandomMask:
    """Per-parameter masks that are never stored: each is redrawn from ``seed`` whenever a pass needs it.

    Each entry is kept with probability ``density``. Masks are drawn parameter by parameter, in the parameters'
    order, from local generators, so every pass over the same parameters (a step's +eps, -eps and update passes)
    sees the same masks, at the cost of one uniform draw per entry and pass instead of one stored byte per entry.
    """

    def __init__(self, seed: int, density: float):
        if not 0.0 < density <= 1.0:
            raise ValueError(f"RandomMask density={density!r} must be in (0, 1]")
        self.seed, self.density = seed, density

    def for_params(self, params: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
        streams = Streams(self.seed)
        for p in params:
            yield _uniform_below(p, self.density, streams.on(p.device))


MASK_SLICE = 1 << 18  # entries per temporary when a mask is drawn, packed or applied piecewise (1 MiB in fp32)


def _uniform_below(p: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """``torch.rand(p.shape, generator=gen) < density`` as a bool tensor, without the full fp32 draw on CPU.

    The CPU generator fills a tensor entry by entry, so drawing it in slices gives the same numbers as one call
    (``tests/test_methods.py`` checks this); CUDA's offsets depend on the call's size, so there it is one call.
    """
    if p.device.type != "cpu" or p.numel() <= MASK_SLICE:
        return torch.rand(p.shape, generator=gen, device=p.device) < density
    out = torch.empty(p.numel(), dtype=torch.bool, device=p.device)
    for start in range(0, p.numel(), MASK_SLICE):
        n = min(MASK_SLICE, p.numel() - start)
        torch.lt(torch.rand(n, generator=gen, device=p.device), density, out=out[start : start + n])
    return out.view(p.shape)


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)
_BIT_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _bit_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(256, 8): row v holds byte v's bits, lowest first (``PackedMask``'s order), as 0 / 1 in ``dtype``."""
    table = _BIT_TABLES.get((device, dtype))
    if table is None:  # threads that race here build the same table
        bits = torch.arange(256, dtype=torch.uint8).unsqueeze(1) >> _BIT_SHIFTS
        table = _BIT_TABLES[(device, dtype)] = bits.bitwise_and_(1).to(device=device, dtype=dtype)
    return table


class PackedMask:
    """A boolean mask kept as bits, eight entries a byte (1/32 of the fp32 weights it masks, not 1/4).

    Sparse-MeZO's magnitude mask covers every weight for the whole run; stored as bools it alone was 13.6 % of
    SmolLM2's inference memory. Entries are unpacked a slice at a time where a pass applies them.
    """

    def __init__(self, bits: torch.Tensor, shape: Sequence[int] | torch.Size):
        self.bits, self.shape = bits, torch.Size(shape)
        self.numel = self.shape.numel()
        if bits.dtype != torch.uint8 or bits.numel() != (self.numel + 7) // 8:
            raise ValueError(f"PackedMask of {self.numel} entries needs {(self.numel + 7) // 8} uint8 bytes, "
                             f"got {bits.numel()} {bits.dtype}")

    @classmethod
    def pack(cls, mask: torch.Tensor) -> "PackedMask":
        flat = mask.reshape(-1)
        bits = torch.empty((flat.numel() + 7) // 8, dtype=torch.uint8, device=mask.device)
        shifts = _BIT_SHIFTS.to(mask.device)
        for start in range(0, flat.numel(), MASK_SLICE):  # MASK_SLICE is a multiple of 8: slices fill whole bytes
            piece = flat[start : start + MASK_SLICE].to(torch.uint8)
            pad = -piece.numel() % 8
            if pad:
                piece = torch.cat([piece, piece.new_zeros(pad)])
            bits[start // 8 : start // 8 + piece.numel() // 8] = (piece.view(-1, 8) << shifts).sum(1, dtype=torch.uint8)
        return cls(bits, mask.shape)

    def unpack(self, start: int = 0, n: int | None = None) -> torch.Tensor:
        """Entries ``start .. start + n`` of the flattened mask, as a bool tensor."""
        n = self.numel - start if n is None else n
        first, skip = divmod(start, 8)
        raw = self.bits[first : (start + n + 7) // 8]
        bits = raw.unsqueeze(1) >> _BIT_SHIFTS.to(raw.device)  # the one temporary: a byte per entry
        return bits.bitwise_and_(1).view(torch.bool).reshape(-1)[skip : skip + n]  # 0 / 1 bytes are bools

    def dense(self) -> torch.Tensor:
        return self.unpack().view(self.shape)

    def to(self, device: torch.device | str) -> "PackedMask":
        return PackedMask(self.bits.to(device), self.shape)

    @torch.no_grad()
    def mul_into_(self, z: torch.Tensor, start: int) -> None:
        """z *= the mask's entries ``start .. start + z.numel()`` (z flat, contiguous), a slice at a time.

        Whole bytes go through a table of each byte's eight bits as 0 / 1 in z's dtype: one gather and one
        same-dtype product, ~3x faster on a CPU than unpacking to bools and multiplying across dtypes. The
        products are those by the bools (by 1 or 0: the same numbers, signed zeros included); the entries
        before the first whole byte and after the last are unpacked."""
        head = min(-start % 8, z.numel())
        body = (z.numel() - head) // 8 * 8
        if head:
            z[:head].mul_(self.unpack(start, head))
        table = _bit_table(z.device, z.dtype)
        for a in range(head, head + body, MASK_SLICE):
            part = z[a : min(a + MASK_SLICE, head + body)]
            first = (start + a) // 8
            part.view(-1, 8).mul_(table.index_select(0, self.bits[first : first + part.numel() // 8].int()))
        if head + body < z.numel():
            z[head + body :].mul_(self.unpack(start + head + body, z.numel() - head - body))


# Which entries each parameter may move: None (all), one mask (a bool tensor, a PackedMask, or None) per
# parameter, or a RandomMask.
Masks = Sequence[torch.Tensor | PackedMask | None] | RandomMask | None

# How z is drawn from a seed (``method.optimizer.noise``). A run's directions depend on it, so it is versioned:
#   per_tensor: one generator call per parameter, in the parameters' order: the stream of every earlier release
#               and the default, so the same seeds give the same directions bit for bit;
#   flat:       the parameters of each (device, dtype), concatenated in order, drawn ``FLAT_BLOCK`` entries per
#               call: hundreds of small adapter tensors take one call. Same distribution, other numbers.
#   blocks:     as ``flat`` with ``BLOCKS_BLOCK`` entries per call, and call b draws from a generator of its own,
#               seeded with ``block_seed(seed, b)``: the calls are independent, so a CPU draws them on
#               ``torch.get_num_threads()`` threads (a CPU generator is serial: one N(0, 1) draw of a 135 M-weight
#               model takes a core about a second), with the same numbers on any number of threads.
NOISE_STREAMS = ("per_tensor", "flat", "blocks")
FLAT_BLOCK = 1 << 22  # entries per generator call of the flat stream: part of its definition (16 MiB in fp32)
BLOCKS_BLOCK = 1 << 20  # entries per generator call of the blocks stream: part of its definition (4 MiB in fp32)
# A pass draws and applies the noise of at most this many bytes of parameters at a time, with one multi-tensor
# (foreach) op per chunk: the pass's only temporary. A larger parameter is a chunk of its own, as it always was.
CHUNK_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class _Block:
    """One generator call: ``numel`` entries on ``device`` in ``dtype``, cut into pieces of parameters."""

    device: torch.device
    dtype: torch.dtype
    numel: int
    pieces: tuple[tuple[int, int, int], ...]  # (parameter index, first flat entry in it, entries), in draw order
    ordinal: int = 0  # the block's place in its layout (the blocks stream seeds its generator with it)


def _per_tensor_blocks(params: Sequence[torch.Tensor]) -> list[_Block]:
    # randn(numel) fills the same numbers as randn(shape): a parameter's z is its flat draw, reshaped.
    return [_Block(p.device, p.dtype, p.numel(), ((i, 0, p.numel()),)) for i, p in enumerate(params)]


def _flat_blocks(params: Sequence[torch.Tensor], size: int) -> list[_Block]:
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    blocks: list[_Block] = []
    for (device, dtype), members in groups.items():
        pieces: list[tuple[int, int, int]] = []
        fill = 0
        for i in members:
            start, n = 0, params[i].numel()
            while start < n:
                take = min(n - start, size - fill)
                pieces.append((i, start, take))
                start, fill = start + take, fill + take
                if fill == size:
                    blocks.append(_Block(device, dtype, fill, tuple(pieces), len(blocks)))
                    pieces, fill = [], 0
        if pieces:
            blocks.append(_Block(device, dtype, fill, tuple(pieces), len(blocks)))
    return blocks


class NoiseLayout:
    """Which generator call draws which entries of which parameter, for one noise stream and parameter list.

    It holds flat views of the parameters, so it is built once for a parameter list and reused by every pass
    (an optimizer keeps it; the functions below build one when they are not given it).
    """

    def __init__(self, params: Sequence[torch.Tensor], stream: str = "per_tensor"):
        if stream not in NOISE_STREAMS:
            raise ValueError(f"noise={stream!r}; known streams: {', '.join(NOISE_STREAMS)}")
        self.stream = stream
        self.params = list(params)
        self.flat = [p.reshape(-1) for p in self.params]
        if any(f.data_ptr() != p.data_ptr() for f, p in zip(self.flat, self.params)):
            raise ValueError("ZO noise needs contiguous parameters, to move them through flat views")
        if stream == "per_tensor":
            self.blocks = _per_tensor_blocks(self.params)
        else:
            self.blocks = _flat_blocks(self.params, FLAT_BLOCK if stream == "flat" else BLOCKS_BLOCK)
        self.numel = sum(p.numel() for p in self.params)
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)
        devices = {p.device for p in self.params}
        self.device = devices.pop() if len(devices) == 1 else None  # the only device, or None
        # Blocks drawn and applied on several CPU threads (``each_draw``): the blocks stream, all on the CPU.
        self.threaded = stream == "blocks" and len(self.blocks) > 1 and all(p.device.type == "cpu" for p in self.params)
        self._chunks: tuple[int, list[list[_Block]]] | None = None

    def matches(self, params: Sequence[torch.Tensor], stream: str) -> bool:
        return (stream == self.stream and len(params) == len(self.params)
                and all(a is b for a, b in zip(params, self.params)))

    def chunks(self) -> list[list[_Block]]:
        """Consecutive blocks of one device and dtype, at most ``CHUNK_BYTES`` together (or one larger block)."""
        if self._chunks is None or self._chunks[0] != CHUNK_BYTES:
            chunks: list[list[_Block]] = []
            size = 0
            for block in self.blocks:
                nbytes = block.numel * block.dtype.itemsize
                last = chunks[-1][0] if chunks else None
                if last is None or size + nbytes > CHUNK_BYTES or (block.device, block.dtype) != (last.device,
                                                                                                    last.dtype):
                    chunks.append([])
                    size = 0
                chunks[-1].append(block)
                size += nbytes
            self._chunks = (CHUNK_BYTES, chunks)
        return self._chunks[1]


def noise_layout(
    params: Sequence[torch.Tensor], noise: str = "per_tensor", layout: NoiseLayout | None = None
) -> NoiseLayout:
    """``layout`` when it was built for these parameters (by identity) and this stream, else a new one."""
    if layout is not None and layout.matches(params, noise):
        return layout
    return NoiseLayout(params, noise)


class _MaskPieces:
    """The mask entries of each piece: a view of a stored mask, or of a random mask drawn when first needed."""

    def __init__(self, layout: NoiseLayout, masks: Masks):
        self._random: Iterator[torch.Tensor] | None = None
        self._stored: Sequence[torch.Tensor | None] | None = None
        if isinstance(masks, RandomMask):
            self._random = masks.for_params(layout.params)
            self._drawn: list[torch.Tensor | None] = []
        elif masks is not None:
            if len(masks) != len(layout.params):
                raise ValueError(f"got {len(masks)} masks for {len(layout.params)} parameters")
            self._stored = masks

    @property
    def any(self) -> bool:
        return self._random is not None or (self._stored is not None and any(m is not None for m in self._stored))

    def _of(self, i: int, start: int, n: int) -> torch.Tensor | PackedMask | None:
        if self._random is not None:
            while len(self._drawn) <= i:  # RandomMask draws in the parameters' order
                self._drawn.append(next(self._random))
            mask = self._drawn[i]
            assert mask is not None, "a random mask was asked for after its parameter's last piece"
            if start + n == mask.numel():
                self._drawn[i] = None  # the parameter's last piece: free its mask
        else:
            mask = self._stored[i] if self._stored is not None else None
            if mask is None or isinstance(mask, PackedMask):
                return mask
        return mask.reshape(-1)[start : start + n]

    def apply_(self, zs: Sequence[torch.Tensor], index: Sequence[int], cut: Sequence[tuple[int, int]]) -> None:
        """z *= its piece's mask entries, for every piece (one foreach op for the unpacked ones)."""
        dense: list[tuple[torch.Tensor, torch.Tensor]] = []
        for z, i, (start, n) in zip(zs, index, cut):
            mask = self._of(i, start, n)
            if isinstance(mask, PackedMask):
                mask.mul_into_(z, start)
            elif mask is not None:
                dense.append((z, mask))
        if dense:
            torch._foreach_mul_([z for z, _ in dense], [m for _, m in dense])


class _Pieces:
    """What a pass hands to ``apply``: each parameter piece's index, its view and its z, with the piece's place
    in its parameter (``cut``: first entry, entries) for the masks."""

    def __init__(self) -> None:
        self.index: list[int] = []
        self.views: list[torch.Tensor] = []
        self.zs: list[torch.Tensor] = []
        self.cut: list[tuple[int, int]] = []

    def add(self, layout: NoiseLayout, block: _Block, start: int, z: torch.Tensor) -> None:
        """The pieces of ``block``'s entries ``start .. start + z.numel()``, whose noise is ``z``."""
        end, offset = start + z.numel(), 0  # offset: where the piece starts in the block
        for i, first, n in block.pieces:
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                flat = layout.flat[i]
                a, b = first + lo - offset, first + hi - offset
                self.index.append(i)
                self.views.append(flat if b - a == flat.numel() else flat[a:b])
                self.zs.append(z[lo - start : hi - start])
                self.cut.append((a, b - a))
            offset += n
            if offset >= end:
                break

    def masked(self, masks: _MaskPieces) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        """(parameter indices, views, z) with z masked. z is drawn in full whatever the mask, so that it is the
        same under any mask and the stream stays aligned."""
        if masks.any:
            masks.apply_(self.zs, self.index, self.cut)
        return self.index, self.views, self.zs


def _draw_chunk(
    layout: NoiseLayout, chunk: Sequence[_Block], streams: Streams, masks: _MaskPieces
) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """(parameter index, parameter view, z) of every piece of ``chunk``: its noise drawn, in order, and masked."""
    pieces = _Pieces()
    for block, z in zip(chunk, _draw_blocks(layout, chunk, streams)):
        pieces.add(layout, block, 0, z)
    return pieces.masked(masks)


def _randn(block: _Block, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(block.numel, generator=generator, device=block.device, dtype=block.dtype)


def _draw_blocks(layout: NoiseLayout, chunk: Sequence[_Block], streams: Streams) -> list[torch.Tensor]:
    """The draw of each block of ``chunk``: in order from the device's stream, or (``blocks``) each from its own
    generator, on several threads where the chunk is on a CPU and torch may use more than one."""
    generators = [streams.drawing(block, layout.stream) for block in chunk]
    if layout.stream != "blocks":
        return [_randn(block, gen) for block, gen in zip(chunk, generators)]
    pool = _draw_pool() if len(chunk) > 1 and chunk[0].device.type == "cpu" else None
    if pool is None:
        return [_randn(block, gen) for block, gen in zip(chunk, generators)]
    # torch.randn releases the GIL and a CPU generator draws on the calling thread only: one core per block.
    futures = [pool.submit(_randn, block, gen) for block, gen in zip(chunk, generators)]
    return [future.result() for future in futures]


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _draw_pool() -> ThreadPoolExecutor | None:
    """Threads for the blocks stream's CPU draws, as many as ``torch.get_num_threads()`` (None for one)."""
    global _POOL
    threads = torch.get_num_threads()
    if threads < 2:
        return None
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != threads:
            if _POOL is not None:
                _POOL[1].shutdown(wait=False)
            _POOL = (threads, ThreadPoolExecutor(threads, thread_name_prefix="adazeta-noise"))
        return _POOL[1]


# A CPU pass draws a large block's noise this many entries at a time into a buffer of its thread's, and applies
# each slice before drawing the next, so that z never leaves the core's cache: a pass is then one read and one
# write of the weights. A CPU generator fills a tensor entry by entry (``normal_`` transforms groups of 16 and
# redraws a tail that is not a multiple of 16), so slices of a multiple of 16 entries, the last one holding the
# remainder, give the numbers of one call (``tests/test_noise_streams.py``). At most ``GRAIN_SIZE`` entries, so
# that a slice's ops run on the calling thread and never fork torch's own threads (the blocks stream's pool).
DRAW_SLICE = 1 << 15
_LOCAL = threading.local()


def _slices(numel: int) -> list[tuple[int, int]]:
    """(start, entries) of consecutive slices of ``numel``: ``DRAW_SLICE`` each (a multiple of 16), the last one
    with the remainder (never under 16 entries, so every slice takes ``normal_``'s vectorised path)."""
    size = DRAW_SLICE
    if size < 16 or size % 16:
        raise ValueError(f"DRAW_SLICE={size} must be a positive multiple of 16")
    cuts = [(start, min(size, numel - start)) for start in range(0, numel, size)]
    if len(cuts) > 1 and cuts[-1][1] < 16:
        _, tail = cuts.pop()
        start, n = cuts.pop()
        cuts.append((start, n + tail))
    return cuts


def _sliced(block: _Block) -> bool:
    """Whether ``block`` is drawn and applied a slice at a time: a CPU block of more than two slices."""
    return block.device.type == "cpu" and block.numel > 2 * DRAW_SLICE


def _buffer(dtype: torch.dtype) -> torch.Tensor:
    """This thread's reusable slice buffer for ``dtype``, with room for a last slice and its remainder."""
    buffers = getattr(_LOCAL, "buffers", None)
    if buffers is None:
        buffers = _LOCAL.buffers = {}
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < DRAW_SLICE + 16:
        buf = buffers[dtype] = torch.empty(DRAW_SLICE + 16, dtype=dtype)
    return buf


def _apply_sliced(layout: NoiseLayout, block: _Block, generator: torch.Generator, masks: _MaskPieces,
                  apply: Callable[[list[int], list[torch.Tensor], list[torch.Tensor]], None]) -> None:
    """``block``'s noise drawn from ``generator`` a slice at a time into this thread's buffer, each slice masked
    and handed to ``apply`` with the parameter views it covers: the numbers of one call, no temporary the size
    of the block. Every pass acts entry by entry, so cutting its pieces changes no number."""
    buf = _buffer(block.dtype)
    for start, n in _slices(block.numel):
        z = buf[:n]
        z.normal_(generator=generator)
        pieces = _Pieces()
        pieces.add(layout, block, start, z)
        apply(*pieces.masked(masks))


_DRAWS = [0]  # whole-set draws of z made in this process (``draws``): read by the bench, never by a step


def draws() -> int:
    """How many times this process has drawn z for a whole trainable set (``each_draw`` and ``flat_directions``
    calls): the bench reads it before and after a step to count the step's passes over the noise."""
    return _DRAWS[0]


def each_draw(layout: NoiseLayout, seed: int, masks: Masks,
              apply: Callable[[list[int], list[torch.Tensor], list[torch.Tensor]], None]) -> None:
    """Draw z from ``seed``, masked, and hand each piece to ``apply(parameter indices, parameter views, z)``.

    A chunk at a time in draw order, one chunk's noise alive at a time, a large CPU block a slice at a time
    (``DRAW_SLICE``); or, for the ``blocks`` stream on a CPU, each block drawn and applied on a thread of
    ``_draw_pool``. ``apply`` must act entry by entry, as every pass does: blocks and slices are disjoint, so each
    entry sees the same operations in the same order and the numbers depend neither on the slicing nor on the
    number of threads.
    """
    _DRAWS[0] += 1
    streams, mask_pieces = Streams(seed), _MaskPieces(layout, masks)
    pool = _draw_pool() if layout.threaded and not isinstance(masks, RandomMask) else None
    if pool is None:
        for chunk in layout.chunks():  # in draw order: the stream is the same however the chunks fall
            run: list[_Block] = []  # consecutive blocks drawn together, in one multi-tensor op
            for block in [*chunk, None]:
                if block is not None and not _sliced(block):
                    run.append(block)
                    continue
                if run:
                    apply(*_draw_chunk(layout, run, streams, mask_pieces))  # its noise freed before the next's
                    run = []
                if block is not None:
                    _apply_sliced(layout, block, streams.drawing(block, layout.stream), mask_pieces, apply)
        return

    grad_enabled = torch.is_grad_enabled()  # thread-local: the caller's (no_grad) is not the pool threads'

    def one(block: _Block) -> None:
        with torch.set_grad_enabled(grad_enabled):  # stored masks are only read: thread-safe
            if _sliced(block):
                _apply_sliced(layout, block, streams.of_block(block), mask_pieces, apply)
            else:
                apply(*_draw_chunk(layout, [block], streams, mask_pieces))

    futures = [pool.submit(one, block) for block in layout.blocks]
    wait(futures)  # every block done before any error is raised: no thread moves weights after the caller fails
    for future in futures:
        future.result()


def flat_directions(layout: NoiseLayout, seed: int, masks: Masks) -> list[torch.Tensor]:
    """z of every parameter as a flat vector (``layout.flat``'s shapes): views of the draws where possible."""
    _DRAWS[0] += 1
    streams, mask_pieces = Streams(seed), _MaskPieces(layout, masks)
    pieces: list[list[torch.Tensor]] = [[] for _ in layout.params]
    for chunk in layout.chunks():
        index, _, zs = _draw_chunk(layout, chunk, streams, mask_pieces)
        for i, z in zip(index, zs):
            pieces[i].append(z)
    return [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in pieces]


@torch.no_grad()
def directions(
    params: Sequence[torch.Tensor],
    seed: int,
    masks: Masks = None,
    noise: str = "per_tensor",
    layout: NoiseLayout | None = None,
) -> list[torch.Tensor]:
    """z for every parameter, exactly as ``perturb_`` draws it from ``seed``, shaped like it (for instruments)."""
    layout = noise_layout(params, noise, layout)
    return [z.view(p.shape) for z, p in zip(flat_directions(layout, seed, masks), layout.params)]


@torch.no_grad()
def perturb_(
    params: Sequence[torch.Tensor],
    seed: int,
    scale: float,
    masks: Masks = None,
    noise: str = "per_tensor",
    z: Sequence[torch.Tensor] | None = None,
    layout: NoiseLayout | None = None,
) -> None:
    """w <- w + scale * z, with z regenerated from ``seed`` (MeZO's perturbation, Algorithm 1), or given as ``z``.

    A given ``z`` is ``DirectionCache.get(seed)``'s (one flat vector per parameter): a step that keeps z draws
    it once for all its passes.
    """
    layout = noise_layout(params, noise, layout)
    if z is not None:
        torch._foreach_add_(layout.flat, list(z), alpha=scale)
        return
    each_draw(layout, seed, masks, lambda index, views, zs: torch._foreach_add_(views, zs, alpha=scale))


class DirectionCache:
    """The z of a step's queries, each drawn once while they fit in ``limit_bytes`` (one step's lifetime).

    ``get(seed)`` returns z drawn as ``directions`` draws it, one flat vector per parameter, keeping it for later passes (the update) while
    all kept z fit in the limit; a z that fits alone but not beside the kept ones is returned without being
    kept (its query's own passes share it). None when even one z is larger than the limit (a full model): the
    caller regenerates z from its seed on every pass, MeZO's trade of time for memory. The numbers are the same.
    """

    def __init__(self, layout: NoiseLayout, masks: Masks = None, limit_bytes: int = 0):
        self.layout, self.masks = layout, masks
        self._size = layout.nbytes
        self._limit = limit_bytes
        self._kept: dict[int, list[torch.Tensor]] = {}

    def get(self, seed: int) -> list[torch.Tensor] | None:
        if seed in self._kept:
            return self._kept[seed]
        if self._size > self._limit or not self.layout.params:
            return None
        z = flat_directions(self.layout, seed, self.masks)
        if (len(self._kept) + 1) * self._size <= self._limit:
            self._kept[seed] = z
        return z

    def keep(self, seeds: Sequence[int]) -> None:
        """Draw and keep the z of ``seeds``, in order, while they fit: the z that a step drawing them in this
        order keeps (a rank of several evaluates only some of a step's queries, but updates with all)."""
        for seed in seeds:
            if self._size > self._limit or not self.layout.params or (len(self._kept) + 1) * self._size > self._limit:
                return
            self.get(seed)

    def peek(self, seed: int) -> list[torch.Tensor] | None:
        """The kept z of ``seed``, or None (never draws)."""
        return self._kept.get(seed)


def projected_gradient(loss_plus: torch.Tensor, loss_minus: torch.Tensor, eps: float) -> torch.Tensor:
    """Central difference (L(w + eps z) - L(w - eps z)) / (2 eps), the gradient's projection on z."""
    # At least fp32, so that a bf16 loss does not round the small difference away; stays on the loss's device.
    dtype = torch.promote_types(torch.promote_types(loss_plus.dtype, loss_minus.dtype), torch.float32)
    return (loss_plus.to(dtype) - loss_minus.to(dtype)) / (2 * eps)


@torch.no_grad()
def zo_update_(
    params: Sequence[torch.Tensor],
    seeds: Sequence[int],
    grads: Sequence[torch.Tensor] | torch.Tensor,
    lr: float | Sequence[float],
    weight_decays: Sequence[float],
    reduction: str = "mean",
    masks: Masks = None,
    noise: str = "per_tensor",
    cache: DirectionCache | None = None,
    layout: NoiseLayout | None = None,
    restore: tuple[int, float] | None = None,
) -> None:
    """w <- w - lr * (g + wd * w), g = (1/Q or 1) * sum_q grad_q * z_q, each z_q regenerated from seeds[q].

    ``grads`` are 0-dim tensors (or one tensor of Q values) left on the device: the update multiplies the noise
    by them, so no value is read back to the host. ``lr`` is one value or one per parameter (param groups).
    ``cache`` supplies the z it kept instead of drawing them again (the same numbers).
    ``restore``: (seed, scale) of the estimate's last perturbation, still to undo (``w += scale * z``) before the
    update. With one query whose z is not kept (a full model), it is undone in the update's own pass over the
    same z: one draw of z instead of two, and every entry sees the same operations in the same order (restore,
    decay, step), so the same numbers. Otherwise it is undone first, as a pass of its own.
    """
    n = len(params)
    lrs = [float(lr)] * n if isinstance(lr, (int, float)) else [float(x) for x in lr]
    if len(lrs) != n or len(weight_decays) != n:
        raise ValueError(f"got {len(lrs)} lrs and {len(weight_decays)} weight decays for {n} parameters")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")
    if len(seeds) != len(grads):
        raise ValueError(f"got {len(seeds)} seeds for {len(grads)} projected gradients")
    grads = torch.stack(list(grads)) if not isinstance(grads, torch.Tensor) else grads.reshape(-1)
    # mean: the reference code's 1/Q; sum: the paper slides' plain sum, whose step grows with Q.
    scale = 1.0 / len(seeds) if reduction == "mean" else 1.0
    coefs = grads * scale  # (Q,) on the device

    layout = noise_layout(params, noise, layout)
    if restore is not None:
        fused = len(seeds) == 1 and seeds[0] == restore[0] and (cache is None or cache.peek(restore[0]) is None)
        if not fused:
            kept = cache.peek(restore[0]) if cache is not None else None
            perturb_(params, restore[0], restore[1], masks, noise, kept, layout)
            restore = None
    if restore is None:
        # Decay first: w (1 - lr wd) - lr g equals w - lr (g + wd w) because g does not depend on w.
        for p, p_lr, wd in zip(params, lrs, weight_decays):
            if wd > 0:
                p.mul_(1.0 - p_lr * wd)

    # Queries outer, parameters inner: each z_q is drawn in the same order as in perturb_, so it is the same z.
    for q, seed in enumerate(seeds):
        kept = cache.peek(seed) if cache is not None else None
        if kept is not None:
            _move(range(n), layout.flat, kept, coefs[q], lrs, layout.device, inplace=False)
            continue

        def apply(index: list[int], views: list[torch.Tensor], zs: list[torch.Tensor], coef=coefs[q]) -> None:
            if restore is not None:  # the estimate's last perturbation undone with this z, then these pieces' decay
                torch._foreach_add_(views, zs, alpha=restore[1])
                for k, i in enumerate(index):
                    if weight_decays[i] > 0:
                        views[k].mul_(1.0 - lrs[i] * weight_decays[i])
            _move(index, views, zs, coef, lrs, layout.device, inplace=True)

        each_draw(layout, seed, masks, apply)


def _move(index: Iterable[int], views: Sequence[torch.Tensor], zs: Sequence[torch.Tensor], coef: torch.Tensor,
          lrs: Sequence[float], device: torch.device | None, inplace: bool) -> None:
    """views[k] += z[k] * (-lr * coef), one multi-tensor op per learning rate and device (``device``: the only
    device of all views, or None). ``inplace``: scale z where it lies (a fresh draw: no second temporary the
    size of a chunk, which for a large embedding is a parameter's size), else into new tensors (kept z)."""
    if device is not None and len(set(lrs)) == 1:
        groups: dict[tuple[float, torch.device], list[int] | None] = {(lrs[0], device): None}  # the common case
    else:
        groups = {}
        for k, i in enumerate(index):
            groups.setdefault((lrs[i], views[k].device), []).append(k)
    for (p_lr, device), members in groups.items():
        c = coef if coef.device == device else coef.to(device, non_blocking=True)
        picked_z = list(zs) if members is None else [zs[k] for k in members]
        picked = list(views) if members is None else [views[k] for k in members]
        # z * (-lr * grad_q / Q) with a 0-dim tensor factor: no host sync (``alpha=`` would need a float).
        if inplace:
            torch._foreach_mul_(picked_z, c * -p_lr)
            torch._foreach_add_(picked, picked_z)
        else:
            moved = torch._foreach_mul(picked_z, c * -p_lr)
            torch._foreach_add_(picked, moved)
            del moved


_NO_DECAY_KEYS = ("bias", "norm", "ln_")  # matched lower-cased, so also LayerNorm, layernorm, RMSNorm, ln_f


def decay_groups(named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """torch-style param groups (with ``param_names``): ``weight_decay`` on weights, 0 on biases and norms."""
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    decay_names: list[str] = []
    no_decay_names: list[str] = []
    for name, p in named_params:
        if any(key in name.lower() for key in _NO_DECAY_KEYS):
            no_decay.append(p)
            no_decay_names.append(name)
        else:
            decay.append(p)
            decay_names.append(name)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "param_names": decay_names},
        {"params": no_decay, "weight_decay": 0.0, "param_names": no_decay_names},
    ]
    # Drop an empty group (e.g. a model without biases): it would only clutter state_dicts and logs.
    return [g for g in groups if g["params"]]

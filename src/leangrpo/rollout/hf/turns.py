"""The hf engine's turn stream: a continuous batch that keeps each trajectory's KV cache.

`HFTurnStream` (a `contracts.TurnStream`, made by `HFEngine.open_turns`) generates the
turns of one multi-turn generation call as they are submitted. Each `advance`:

1. admits waiting turns, first come first served, while the batch has fewer than
   `max_rows` rows and its KV fits the budget: a turn whose key has a kept cache that its
   ids extend gets that cache copied into its row and prefills only the rest (the last
   turn's EOS and the environment's segment); any other turn prefills all its ids. The
   turns admitted together are prefilled in one forward, left-padded to the longest new
   part (padding tokens are never written to the cache); each one's first token is drawn
   from its own uniforms;
2. runs one decode step over every row: (b, 1) tokens at each row's own position, the
   attention mask cut at each row's length (no mask when every row fills the width);
3. ends the rows that stopped (EOS, a stop string, their own budget): each becomes a
   `Completion`, its keys/values up to the last fed token are kept under its key, and the
   batch's last row moves into its place (the running rows stay rows 0..b-1 of the slot
   cache, so a step copies nothing).

Budget (`kv_cache_tokens`): the slot cache's allocation (rows x width, padding included)
plus the kept caches. Kept caches are evicted least recently used to make room for a
turn (for the rows and width it needs, never for the slot cache's growth ahead of need),
or after one is added, once the slot cache has given back the rows no turn uses (all of
them when the batch is empty); a turn that still does not fit waits for rows to leave. An
evicted trajectory's next turn prefills all its ids (counted). Choices:

- Prefills of joining turns are batched with each other, never with decode steps: a
  decode row never pays for another's prefill width. With `max_rows` 1 every forward
  holds one sequence, so a trajectory's arithmetic is its own (the batch-invariant mode).
- A lone row prefilled from scratch, and decode steps whose rows all fill the width,
  run without a mask (transformers' causal SDPA path), as decode.py's loop does.
- Sliding-window layers (Mistral, Qwen2/3 with a window): the masks are always explicit,
  theirs cut to the window (a mask per layer type when full layers are mixed in), as the
  model's own forward would; the cache keeps every position.
- Sampling: decode.py's `sample_next`, one generator per request (seeded: its own seed;
  unseeded: from the OS; greedy: none), so a turn's draws never depend on its batch. A
  row draws its uniforms DRAW_BLOCK at a time (on CPU the same values as one call per
  token; a call per row and step cost a tenth of a decode step, and on a GPU it would be
  a kernel launch per row); each step takes the next one of each row.
- Tokens and log-probs of a step cross to the host in one copy.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from leangrpo.contracts import Completion, SamplingParams, TurnRequest
from leangrpo.rollout.hf.decode import (
    DecodedRow,
    append_token,
    cache_kwarg_name,
    causal_lm,
    forward_last,
    sample_next,
)
from leangrpo.rollout.hf.kv_cache import Kept, KeptCaches, SlotCache


@dataclass
class _Row:
    """One turn in the batch."""

    request: TurnRequest
    generator: torch.Generator | None  # its own stream (greedy: None)
    length: int = 0  # positions in the cache: tokens fed so far
    out: DecodedRow = field(default_factory=DecodedRow)
    draws: list[float] = field(default_factory=list)  # uniforms drawn, not yet used

    def next_uniform(self) -> float:
        """The row's next draw; its generator is asked for DRAW_BLOCK at a time."""
        if not self.draws:
            block = torch.rand(DRAW_BLOCK, generator=self.generator, dtype=torch.float64,
                               device=self.generator.device)  # fmt: skip
            self.draws = block.tolist()[::-1]
        return self.draws.pop()

    @property
    def bound(self) -> int:
        return _bound(self.request)


@dataclass
class _Joining:
    request: TurnRequest
    start: int  # positions taken from a kept cache


class HFTurnStream:
    """See the module docstring. Built by `HFEngine.open_turns`; one thread drives it."""

    def __init__(
        self,
        model,
        params: SamplingParams,
        *,
        eos_ids: set[int],
        device: torch.device,
        completion: Callable[[DecodedRow, SamplingParams], Completion],
        stop_text: Callable[[list[int]], str],
        max_rows: int | None = None,
        kv_cache_tokens: int | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        self.model = model
        self.params = params
        self.eos_ids = eos_ids
        self.device = device
        self.max_rows = max_rows or 1 << 30
        self.budget = kv_cache_tokens
        self._completion = completion
        self._stop_text = stop_text
        self._on_close = on_close
        self._cache_kwarg = cache_kwarg_name(model)
        self._eager = getattr(causal_lm(model).config, "_attn_implementation", "") == "eager"
        self._window, self._per_type = _sliding_window(causal_lm(model).config)
        self.cache = SlotCache(causal_lm(model).config.num_hidden_layers)
        self.kept = KeptCaches()
        self.rows: list[_Row] = []
        self.waiting: deque[TurnRequest] = deque()
        self.stats: Counter[str] = Counter()
        self._closed = False

    # -- the protocol ----------------------------------------------------------------------
    def submit(self, request: TurnRequest) -> None:
        if self._closed:
            raise RuntimeError("this turn stream is closed")
        if not request.ids or request.max_new_tokens < 1:
            raise ValueError("a turn request needs token ids and max_new_tokens >= 1")
        need = _bound(request)
        if self.budget is not None and need > self.budget:
            raise ValueError(
                f"rollout.kv_cache_tokens = {self.budget} cannot hold one turn of {need} "
                "positions (its ids and max_new_tokens); raise it to at least "
                "environment.max_total_tokens"
            )
        self.waiting.append(request)

    def pending(self) -> int:
        return len(self.waiting) + len(self.rows)

    def advance(self, timeout_s: float = 0.0) -> list[tuple[TurnRequest, Completion]]:
        with torch.no_grad():
            done = self._admit()
            if self.rows:
                done += self._decode_step()
        return done

    def release(self, key: int) -> None:
        self.kept.drop(key)

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.stats.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.rows.clear()
        self.waiting.clear()
        self.kept.clear()
        self.cache = SlotCache(0)
        if self._on_close is not None:
            self._on_close()

    def __enter__(self) -> HFTurnStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- admission --------------------------------------------------------------------------
    def _admit(self) -> list[tuple[TurnRequest, Completion]]:
        joining: list[_Joining] = []
        room = self._room_for_waiting()
        widest = max((row.bound for row in self.rows), default=0)  # and the joining turns'
        while self.waiting and len(self.rows) + len(joining) < self.max_rows:
            request = self.waiting[0]
            kept = self._kept_prefix(request)
            rows = len(self.rows) + len(joining) + 1
            width = max(widest, _bound(request))
            if not self._make_room(rows, width, room):
                if kept is not None:
                    self.kept.put(request.key, kept)
                if not self.rows and not joining:
                    raise RuntimeError(
                        f"rollout.kv_cache_tokens = {self.budget} cannot hold a turn of "
                        f"{_bound(request)} positions"
                    )
                break
            self.waiting.popleft()
            start = 0
            if kept is not None:
                self.cache.load_row(rows - 1, kept.layers)
                start = len(kept.ids)
            joining.append(_Joining(request, start))
            widest = width
        if not joining:
            return []
        return self._prefill(joining)

    def _kept_prefix(self, request: TurnRequest) -> Kept | None:
        """The key's kept cache if the request's ids extend it (taken out of the store)."""
        if request.key is None:
            return None
        kept = self.kept.take(request.key)
        if kept is None:
            return None
        if len(kept.ids) >= len(request.ids) or request.ids[: len(kept.ids)] != kept.ids:
            self.stats["cache_misses"] += 1
            return None
        return kept

    def _room_for_waiting(self) -> tuple[int, int]:
        """Without a budget: rows and width for every waiting turn that may join now, so
        that the slot cache grows once for them, not once per doubling (each growth copies
        the whole cache). Under a budget: (0, 0), growth by doubling (a larger cache would
        evict kept caches for turns that might not fit anyway)."""
        if self.budget is not None or not self.waiting:
            return 0, 0
        rows = min(self.max_rows, len(self.rows) + len(self.waiting))
        joining = [self.waiting[i] for i in range(max(0, rows - len(self.rows)))]
        return rows, max((_bound(r) for r in joining), default=0)

    def _make_room(self, rows: int, width: int, room: tuple[int, int] = (0, 0)) -> bool:
        """Size the slot cache for `rows` rows of `width` positions (`width` covers every
        row in use), evicting kept caches (oldest first) when the budget asks for it; False
        when it cannot fit now. Rows grow by doubling (at once to `room`'s rows when
        given), the width in steps of WIDTH_STEP, as far as the budget holds them beside
        the kept caches; a kept cache is evicted only for the size the turn needs, never
        for growth ahead of need. Shrinks only to fit the budget."""
        current = (self.cache.rows, self.cache.width)
        if rows <= current[0] and width <= current[1] and self._fits(*current):
            return True
        stepped = -(-max(width, room[1]) // WIDTH_STEP) * WIDTH_STEP
        grown = (_grown(current[0], max(rows, room[0]), self.max_rows), max(stepped, current[1]))
        for target, evict in ((grown, False), ((rows, stepped), False), ((rows, width), True)):
            if self._fits(*target, evict=evict):
                self.cache.resize(*target)
                return True
        return False

    def _fits(self, rows: int, width: int, evict: bool = False) -> bool:
        """Whether a slot cache of rows x width fits beside the kept caches (evicting them,
        oldest first, if `evict`)."""
        if self.budget is None:
            return True
        if rows * width > self.budget:
            return False
        while rows * width + self.kept.tokens > self.budget:
            if not evict or not self.kept.evict_oldest():
                return False
            self.stats["cache_evictions"] += 1
        return True

    def _enforce_budget(self) -> None:
        """After a row ended (its cache kept): over the budget, the slot cache first gives
        back the rows no turn uses (all of it when the batch is empty), then kept caches
        are evicted, oldest first: an idle allocation never costs a kept cache."""
        if self.budget is None:
            return
        if self.cache.allocated + self.kept.tokens > self.budget:
            if not self.rows:
                self.cache = SlotCache(len(self.cache.buffers))
            elif len(self.rows) < self.cache.rows:
                self.cache.resize(len(self.rows), self.cache.width)
        while self.cache.allocated + self.kept.tokens > self.budget and self.kept.evict_oldest():
            self.stats["cache_evictions"] += 1

    # -- forwards ---------------------------------------------------------------------------
    def _prefill(self, joining: list[_Joining]) -> list[tuple[TurnRequest, Completion]]:
        """One forward over the joining turns' new tokens (rows b..b+j-1, left-padded)."""
        first, count = len(self.rows), len(joining)
        news = [j.request.ids[j.start :] for j in joining]
        width_q = max(len(n) for n in news)
        ids = torch.zeros(count, width_q, dtype=torch.long)
        positions = torch.zeros(count, width_q, dtype=torch.long)
        real = torch.zeros(count, width_q, dtype=torch.bool)
        for i, (j, new) in enumerate(zip(joining, news)):
            pad = width_q - len(new)
            ids[i, pad:] = torch.tensor(new)
            positions[i, pad:] = torch.arange(j.start, j.start + len(new))
            real[i, pad:] = True
        ends = [j.start + len(n) for j, n in zip(joining, news)]
        width = max(ends)
        rows_of = torch.arange(first, first + count)[:, None].expand(count, width_q)
        self.cache.prepare(
            first,
            count,
            width,
            rows_of[real].to(self.device),
            positions[real].to(self.device),
            None if bool(real.all()) else real.reshape(-1).to(self.device),
        )
        plain = count == 1 and joining[0].start == 0 and self._window is None  # no mask needed
        mask = None if plain else self._prefill_mask(positions, real, width)
        logits = self._forward(ids, mask, positions)
        self.stats["prefill_tokens"] += sum(len(n) for n in news)
        self.stats["prefill_tokens_saved"] += sum(j.start for j in joining)
        self.stats["prefills"] += 1
        self.stats["prefills_beside_decoding"] += first > 0  # joined a running batch
        for j, end in zip(joining, ends):
            self.rows.append(_Row(j.request, self._generator(j.request), length=end))
        return self._sample(logits, range(first, first + count))

    def _decode_step(self) -> list[tuple[TurnRequest, Completion]]:
        b = len(self.rows)
        lengths = torch.tensor([row.length for row in self.rows])
        tokens = torch.tensor([row.out.ids[-1] for row in self.rows])[:, None]
        width = int(lengths.max()) + 1
        self.cache.prepare(
            0,
            b,
            width,
            torch.arange(b, device=self.device),
            lengths.to(self.device),
            query_offset=width - 1,
        )
        mask = None
        if int(lengths.min()) + 1 != width or self._window is not None:  # not plain causal
            keys = torch.arange(width)
            allowed = (keys[None, :] <= lengths[:, None])[:, None, None, :]
            mask = self._masks(allowed, lengths[:, None])
        logits = self._forward(tokens, mask, lengths[:, None])
        for row in self.rows:
            row.length += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += b
        return self._sample(logits, range(b))

    def _prefill_mask(self, positions: torch.Tensor, real: torch.Tensor, width: int):
        """(j, 1, q, width): a real query at position p sees keys 0..p; padding sees key 0."""
        keys = torch.arange(width)
        mask = keys[None, None, :] <= positions[:, :, None]  # (j, q, width)
        mask &= real[:, :, None]
        mask[:, :, 0] |= ~real
        return self._masks(mask[:, None], positions)

    def _masks(self, allowed: torch.Tensor, positions: torch.Tensor):
        """The forward's attention mask from `allowed` (rows, 1, q, width: key visible from
        query) and the queries' positions (rows, q): with sliding-window layers, their mask
        sees only the window's last keys (a dict by layer type when the model mixes them,
        as transformers' own `causal_mask_mapping`)."""
        if self._window is None:
            return self._mask_format(allowed)
        keys = torch.arange(allowed.shape[-1])
        windowed = allowed & (keys > positions[:, None, :, None] - self._window)
        if not self._per_type:
            return self._mask_format(windowed)
        return {
            "full_attention": self._mask_format(allowed),
            "sliding_attention": self._mask_format(windowed),
        }

    def _mask_format(self, mask: torch.Tensor) -> torch.Tensor:
        """Boolean (True = attend) for SDPA and leangrpo's adapter; additive for eager."""
        mask = mask.to(self.device)
        if not self._eager:
            return mask
        dtype = next(self.model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=self.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )

    def _forward(self, ids: torch.Tensor, mask, positions: torch.Tensor) -> torch.Tensor:
        return forward_last(
            self.model,
            self._cache_kwarg,
            ids.to(self.device),
            mask,
            positions.to(self.device),
            self.cache,
        )

    # -- sampling and endings ---------------------------------------------------------------
    def _generator(self, request: TurnRequest) -> torch.Generator | None:
        if self.params.temperature == 0:
            return None
        generator = torch.Generator(device=self.device)
        if request.seed is None:
            generator.seed()  # from the OS: the global RNG stays untouched
        else:
            generator.manual_seed(request.seed)
        return generator

    def _sample(self, logits: torch.Tensor, rows: range) -> list[tuple[TurnRequest, Completion]]:
        """Draw one token for each of `rows` (their logits, in order); end the rows that stop."""
        uniforms = None
        if self.params.temperature != 0:
            drawn = [self.rows[i].next_uniform() for i in rows]
            uniforms = torch.tensor(drawn, dtype=torch.float64, device=self.device)[:, None]
        tokens, logprobs = sample_next(logits, self.params, None, uniforms)
        host = torch.stack([tokens.double(), logprobs.double()]).tolist()  # one copy
        if host[0] and min(host[0]) < 0:
            raise RuntimeError("the model's logits are not finite: no token can be sampled")
        ended = []
        for i, token, logprob in zip(rows, host[0], host[1]):
            row = self.rows[i]
            row.out.logprobs.append(float(logprob))
            stopped = append_token(
                row.out, int(token), self.eos_ids, self.params.stop, self._stop_text
            )
            if stopped or len(row.out.ids) >= row.request.max_new_tokens:
                ended.append(i)
        return [self._end(i) for i in sorted(ended, reverse=True)][::-1]

    def _end(self, i: int) -> tuple[TurnRequest, Completion]:
        """Row i's turn is done: keep its cache under its key, fill its place with the last row."""
        row = self.rows[i]
        key = row.request.key
        if key is not None:
            ids = list(row.request.ids) + row.out.ids[:-1]  # the last token was never fed
            self.kept.put(key, Kept(ids, self.cache.read_row(i, row.length)))
        last = len(self.rows) - 1
        if i != last:
            self.cache.move_row(last, i)
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self._enforce_budget()
        return row.request, self._completion(row.out, self.params)


WIDTH_STEP = 64  # the slot cache's width grows in steps of this many positions
DRAW_BLOCK = 64  # uniforms a row draws from its generator at a time


def _sliding_window(config) -> tuple[int | None, bool]:
    """The window of the model's sliding-window layers (None: none has one; their layers as
    transformers' `DynamicCache` makes them) and whether the model mixes them with full
    attention layers (`config.layer_types`: its forward takes a mask per layer type)."""
    from transformers import DynamicCache

    layers = DynamicCache(config=config).layers
    windows = {getattr(layer, "sliding_window", None) for layer in layers} - {None}
    if not windows:
        return None, False
    types = set(getattr(config, "layer_types", None) or ())
    if len(windows) > 1 or not types <= {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"the hf engine's multi-turn stream supports full and sliding-window attention "
            f"with one window; this model has windows {sorted(windows)} and layer types "
            f"{sorted(types)}: use rollout.engine: vllm"
        )
    return windows.pop(), bool(types)


def _bound(request: TurnRequest) -> int:
    """Positions a turn's row may reach: its ids and its whole budget."""
    return len(request.ids) + request.max_new_tokens


def _grown(current: int, needed: int, limit: int | None) -> int:
    """Doubling growth to at least `needed`, at most `limit` (but never below `needed`)."""
    if needed <= current:
        return current
    target = max(needed, 2 * current)
    return max(needed, min(target, limit)) if limit is not None else target

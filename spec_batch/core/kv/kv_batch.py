"""A model's KV cache for a batch of rows that advance by different amounts.

Every row shares one cache tensor layout; a per-row validity mask marks which cache columns hold the row's
tokens. Rolling a row back after a rejection only clears its last columns in the mask (a "hole"), so rows
never wait for each other and the prefix is never recomputed. Positions come from the mask, so holes cost
memory, not correctness; `compact` squeezes them out with a gather when they pile up.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch

from . import padding
from .hf_compat import Cache, DynamicLayer

HEADROOM = 128  # free columns a slab gets where it is allocated anew: the next steps append without a copy


class SlabLayer(DynamicLayer):
    """A cache layer with preallocated, doubling capacity: appends write in place instead of torch.cat.
    storage_dtype: the dtype keys and values are kept in (None: theirs); a model may ask for a wider one
    (`kv_storage_dtype`) when its attention computes in it."""

    def __init__(self, storage_dtype: torch.dtype | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.storage_dtype = storage_dtype

    # keys and values are views of the slabs' first `length` columns, made where read (a decode step writes its
    # columns natively and reads none of them from Python: `room`, `advance`)
    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        return self._kbuf[:, :, : self.length] if self.is_initialized else None

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:  # the base class sets None; anything else would not reach the slab
            raise AttributeError("a SlabLayer's keys are its slab's first `length` columns")

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        return self._vbuf[:, :, : self.length] if self.is_initialized else None

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError("a SlabLayer's values are its slab's first `length` columns")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.storage_dtype or key_states.dtype, key_states.device
        self._kbuf = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]), dtype=self.dtype)
        self._vbuf = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]), dtype=self.dtype)
        self.length = 0
        self.is_initialized = True

    def room(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The key and value slabs [B, heads, capacity, D] with room for n more columns, and the columns held. A
        caller that writes the n new columns itself (loading/llama_forward.py, in the attention's native call)
        then calls `advance(n)`."""
        self._reserve(self.length + n)
        return self._kbuf, self._vbuf, self.length

    def advance(self, n: int) -> None:
        """The n columns after `length` were written (`room`)."""
        self.length += n

    def _reserve(self, needed: int) -> None:
        capacity = self._kbuf.shape[2]
        if needed <= capacity:
            return
        new_cap = max(needed + HEADROOM, 2 * capacity)
        for name in ("_kbuf", "_vbuf"):
            old = getattr(self, name)
            buf = old.new_empty((*old.shape[:2], new_cap, old.shape[3]))
            buf[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, buf)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        keys, values, length = self.room(n)
        keys.narrow(2, length, n).copy_(key_states)
        values.narrow(2, length, n).copy_(value_states)
        self.advance(n)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if self.is_initialized and tokens_to_remove < 0:
            self.length = max(0, self.length + tokens_to_remove)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices.tolist(), indices)

    def select_rows(self, order: list[int], indices: torch.Tensor) -> None:
        """Only the rows order[i] (indices: the same, a tensor) stay, in this order. Where each row either stays
        in place or comes from beyond the new batch (a leaving row's place taken by one from the end: what the
        running batch asks), the moved rows are copied within the slabs and nothing else is; else one gather
        into new slabs with room to grow."""
        if not self.is_initialized:
            return
        n = len(order)
        if all(src == i or src >= n for i, src in enumerate(order)) and len(set(order)) == n:
            with torch.inference_mode():  # the slabs may be inference tensors (written in a decode step)
                for i, src in enumerate(order):
                    if src != i:
                        for buf in (self._kbuf, self._vbuf):
                            buf[i, :, : self.length].copy_(buf[src, :, : self.length])
            self._kbuf, self._vbuf = self._kbuf[:n], self._vbuf[:n]
            return
        for name in ("_kbuf", "_vbuf"):
            old = getattr(self, name)
            buf = old.new_empty((n, old.shape[1], self.length + HEADROOM, old.shape[3]))
            buf[:, :, : self.length] = old[indices, :, : self.length]
            setattr(self, name, buf)

    def gather_columns(self, columns: torch.Tensor) -> None:
        """Keeps, for each row b, the columns columns[b] (in order). columns [B, new_len]."""
        if not self.is_initialized:
            return
        idx = columns.view(columns.shape[0], 1, columns.shape[1], 1)
        idx = idx.expand(-1, self._kbuf.shape[1], -1, self._kbuf.shape[3])
        self._kbuf = self._kbuf[:, :, : self.length].gather(2, idx)
        self._vbuf = self._vbuf[:, :, : self.length].gather(2, idx)
        self.length = columns.shape[1]

    def add_rows(self, n: int) -> None:
        """n new rows below ours, holding nothing (masked columns)."""
        if self.is_initialized:
            for name in ("_kbuf", "_vbuf"):
                old = getattr(self, name)[:, :, : self.length]
                setattr(self, name, torch.cat([old, old.new_zeros((n, *old.shape[1:]))], dim=0))

    def concat_rows(self, other: SlabLayer) -> None:
        """Appends other's rows below ours, the shorter side's columns shifted right (zeros before them, which
        its rows' masks hide). Where other is no longer than us and our slabs' storage still holds the places of
        rows that left (`select_rows` keeps them), other's rows are written there: one copy of their side only (a
        server admitting a request into a batch of 16 long rows copied all of them, ~10 ms an admission). Else
        into new slabs with room to grow: one copy of each side."""
        if other.length <= self.length and self._free_rows() >= other._kbuf.shape[0]:
            self._write_below(other)
            return
        length = max(self.length, other.length)
        for name in ("_kbuf", "_vbuf"):
            mine, theirs = getattr(self, name), getattr(other, name)
            buf = mine.new_empty((mine.shape[0] + theirs.shape[0], mine.shape[1], length + HEADROOM, mine.shape[3]))
            _right_aligned(buf[: mine.shape[0]], mine, self.length, length)
            _right_aligned(buf[mine.shape[0] :], theirs, other.length, length)
            setattr(self, name, buf)
        self.length = length

    def _free_rows(self) -> int:
        """Rows our slabs' storage holds below the rows in use, at the slabs' layout (0 where it is not a row
        prefix of a contiguous slab)."""
        free = []
        for buf in (self._kbuf, self._vbuf):
            if not buf.is_contiguous() or buf.numel() == 0:
                return 0
            elements = buf.untyped_storage().nbytes() // buf.element_size() - buf.storage_offset()
            free.append(elements // buf.stride(0) - buf.shape[0])
        return min(free)

    def _write_below(self, other: SlabLayer) -> None:
        """other's rows into the free rows below ours, right-aligned to our length, zeros before them."""
        rows = self._kbuf.shape[0] + other._kbuf.shape[0]
        for name in ("_kbuf", "_vbuf"):
            mine, theirs = getattr(self, name), getattr(other, name)
            whole = mine.as_strided((rows, *mine.shape[1:]), mine.stride(), mine.storage_offset())
            with torch.inference_mode():  # the slabs may be inference tensors (written in a decode step)
                _right_aligned(whole[mine.shape[0] :], theirs, other.length, self.length)
            setattr(self, name, whole)


def _right_aligned(part: torch.Tensor, side: torch.Tensor, held: int, length: int) -> None:
    """part[:, :, :length] = side's first `held` columns, right-aligned, zeros before them (which the rows' masks
    hide)."""
    part[:, :, : length - held].zero_()
    part[:, :, length - held : length].copy_(side[:, :, :held])


def kv_storage_dtype(model) -> torch.dtype | None:
    """The dtype a model's attention wants its keys and values in, where it says (loading/cpu_attention.py sets
    float64 on CPU models, whose attention computes in it); None: the model's own."""
    return getattr(model, "spec_batch_kv_dtype", None)


def supports_model(model) -> str | None:
    """None if the model's attention fits this cache; otherwise why not."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))} (only full attention is supported)"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    return None


def left_padded(
    seqs: Sequence[Sequence[int]], placeholder_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists as one input: ids [B, width] with each list right-aligned after placeholders, and
    valid [B, width] (True on real tokens); width >= 1, so rows with nothing to add still fit a forward."""
    width = max(1, max((len(s) for s in seqs), default=0))
    ids = torch.tensor([[placeholder_id] * (width - len(s)) + list(s) for s in seqs], dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    valid = torch.arange(width).unsqueeze(0) >= (width - lengths).unsqueeze(1)
    return ids.view(len(seqs), width).to(device), valid.to(device)


class KVBatch:
    """One model, its cache, and which cache columns each row owns."""

    def __init__(self, model, device: torch.device, batch: int):
        self.model = model
        self.device = device
        self.cache = Cache(layer_class_to_replicate=functools.partial(SlabLayer, kv_storage_dtype(model)))
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)  # [B, cache_len], 1 = the row's token
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)  # [B] = valid entries per row
        # publish each forward's real positions only to a model with a layer that reads them (no sync elsewhere)
        self.skips_padding = padding.skips_padding(model)

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Appends input_ids [B, n] (valid [B, n] bool marks real tokens) and returns logits [B, n or keep, V]."""
        return self.forward_output(input_ids, valid, logits_to_keep).logits

    def forward_output(
        self, input_ids: torch.Tensor, valid: torch.Tensor, logits_to_keep: int = 0, **model_kwargs: Any
    ) -> Any:
        """`forward`, returning the model's whole output; model_kwargs go to the model (a draft head's features)."""
        valid_l = valid.long()
        positions = (self.next_pos.unsqueeze(1) + valid_l.cumsum(dim=1) - 1).clamp_min(0)
        mask = torch.cat([self.mask, valid_l], dim=1)
        return self._append(input_ids, valid, mask, positions, logits_to_keep, **model_kwargs)

    def forward_tree(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        positions: torch.Tensor,
        attend: torch.Tensor,
        logits_to_keep: int = 0,
        hidden_columns: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> Any:
        """`forward_output` for a tree of tokens (core/drafting/tree.py): input position q sees the row's cache and the new
        positions c with attend[b, q, c] (its ancestors and itself), at the given positions [B, n] (a tree's
        tokens share positions: next_pos + depth).
        hidden_columns [B, n, L] bool: cache columns a position must not see (a drafter's own tree nodes from earlier
        forwards that are not its ancestors); None: it sees every valid column. The new entries count as valid
        until `keep_last` or `rollback` says which stay."""
        # a padded position sees only itself: never empty, and no attention work spent on what nothing reads
        cached = self.mask.bool().unsqueeze(1) & valid.unsqueeze(2)  # [B, n, L]
        if hidden_columns is not None:
            cached = cached & ~hidden_columns
        mask = torch.cat([cached, attend & valid.unsqueeze(1) & valid.unsqueeze(2)], dim=2)
        n = input_ids.shape[1]
        cols = torch.arange(n, device=mask.device)
        mask[:, cols, self.length + cols] = True
        # 4-D: used as it is (transformers' masking_utils)
        return self._append(input_ids, valid, mask.unsqueeze(1), positions, logits_to_keep, **model_kwargs)

    def _append(
        self,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        logits_to_keep: int,
        **model_kwargs: Any,
    ) -> Any:
        """One model call appending input_ids to the cache; the valid ones join their rows' columns."""
        hint = padding.real_positions(valid) if self.skips_padding else contextlib.nullcontext()
        own = getattr(self.model, "spec_batch_forward", None)  # loading/llama_forward.py: the same bits, faster
        call = own if own is not None and own.usable(model_kwargs) else self.model
        with hint:  # layers that can skip the padded positions do (core/kv/padding.py)
            out = call(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=positions,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **model_kwargs,
            )
        valid_l = valid.long()
        self.mask = torch.cat([self.mask, valid_l], dim=1)
        self.next_pos = self.next_pos + valid_l.sum(dim=1)
        return out

    def keep_last(self, keep: torch.Tensor) -> None:
        """Of the last n columns (a tree forward's), keeps only those with keep [B, n] (an accepted path)."""
        n = keep.shape[1]
        last = self.mask[:, -n:]
        dropped = (last.bool() & ~keep).sum(dim=1)
        self.mask = torch.cat([self.mask[:, :-n], last * keep.long()], dim=1)
        self.next_pos = self.next_pos - dropped
        self._trim_tail()

    def rollback(self, drop: torch.Tensor) -> None:
        """Forgets each row's last drop[b] tokens. drop [B] long."""
        if not bool((drop > 0).any()):
            return
        valid_from_end = self.mask.flip(1).cumsum(dim=1).flip(1)  # valid entries at or after each column
        kill = (valid_from_end <= drop.unsqueeze(1)) & (self.mask == 1)
        self.mask = self.mask.masked_fill(kill, 0)
        self.next_pos = self.next_pos - drop
        self._trim_tail()

    def _trim_tail(self) -> None:
        used = self.mask.any(dim=0).nonzero()
        keep = int(used.max()) + 1 if used.numel() else 0
        if keep < self.length:
            self.cache.crop(keep - self.length)
            self.mask = self.mask[:, :keep]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Only these rows stay, in this order (running_batch's `fill_order` keeps the copying to moved rows)."""
        order = rows.tolist()
        for layer in self.cache.layers:
            layer.select_rows(order, rows)
        self.mask = self.mask[rows]
        self.next_pos = self.next_pos[rows]
        self._trim_tail()
        self.maybe_compact()

    def maybe_compact(self) -> None:
        """Squeezes holes out once they waste more than a third of the cache."""
        longest = int(self.next_pos.max()) if self.batch else 0
        if self.length <= 1.5 * longest + 32:
            return
        # row b keeps its valid columns, right-aligned; left padding points at column 0 and is masked
        order = torch.arange(self.length, device=self.device).expand(self.batch, -1)
        key = torch.where(self.mask == 1, order, order - self.length)  # valid columns sort last, in order
        columns = key.sort(dim=1).indices[:, self.length - longest :]
        new_mask = self.mask.gather(1, columns)
        columns = torch.where(new_mask == 1, columns, torch.zeros_like(columns))
        for layer in self.cache.layers:
            layer.gather_columns(columns)
        self.mask = new_mask

    def add_empty_rows(self, n: int) -> None:
        """n new rows below ours that hold no tokens yet (a drafter whose rows' first entries come later)."""
        for layer in self.cache.layers:
            layer.add_rows(n)
        self.mask = torch.cat([self.mask, self.mask.new_zeros(n, self.length)], dim=0)
        self.next_pos = torch.cat([self.next_pos, self.next_pos.new_zeros(n)], dim=0)

    def extend(self, other: KVBatch) -> None:
        """Appends other's rows (a freshly prefilled group) below ours, aligning cache lengths on the left."""
        if self.batch == 0:
            self.cache, self.mask, self.next_pos = other.cache, other.mask, other.next_pos
            return
        diff = self.length - other.length
        shorter, pad = (other, diff) if diff > 0 else (self, -diff)
        if pad:  # the shorter side's columns move right: its slabs in concat_rows, its mask here
            shorter.mask = torch.cat([shorter.mask.new_zeros(shorter.batch, pad), shorter.mask], dim=1)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.concat_rows(theirs)
        self.mask = torch.cat([self.mask, other.mask], dim=0)
        self.next_pos = torch.cat([self.next_pos, other.next_pos], dim=0)

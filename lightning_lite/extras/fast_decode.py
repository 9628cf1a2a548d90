"""Decoding at agent-length contexts, for the embedded backend, and the trainer's attention on a
CPU. Imported, this module sets ``hooks.fast_decode`` to itself (hooks.NoFastDecode's protocol):
backends.HFBackend then keeps a ``PrefixCache``, calls ``install(model)``, and makes its batch's
cache layers ``RoomyLayer``s (``batch_cache``); trainer.Learner calls ``install_trainer(model)``,
which runs a packed tree's attention on a CPU as ``block_sdpa``. Without it the backend prefills
every prompt whole and decodes with transformers' own attention and cache layers, and the trainer
runs transformers' SDPA over the whole mask: the same numbers, slower.

An agent's next turn extends its last one, and a GRPO group's requests share one prompt: the prefix
cache keeps the KV of what was prefilled or decoded before, so such a prompt prefills only its new
tokens.

Two copies per decode step dominate once the context is long (8k tokens, 135M model: ~1.5 GB of
memory traffic per token against 0.5 GB of weights): DynamicCache appends by torch.cat, copying the
whole cache, and transformers' SDPA repeats every KV head for each of its query heads whenever a
mask is given, which batched decoding always does. The layer appends in place; the attention groups
query heads instead.

At a few rows per step on a CPU, the linear layers' product is computed weight-first
(``_skinny_linear``): MKL then packs only the rows, not every weight at every step.

A packed tree's attention mask (algo.tree_mask) is mostly False: a GRPO group's replies see their
prompt and themselves, not the other groups. ``block_sdpa`` runs each block of 128 query rows over
only the keys that the block sees.
"""

import os
import sys
import types
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .. import hooks


class PrefixCache:
    """The KV of token sequences the backend prefilled or decoded (a prompt; a finished reply's
    prompt + response[:-1]), up to ``max_tokens`` tokens in all, the least recently used leaving
    first. A prompt's entry keeps the logits after it too: a GRPO group's other requests, the same
    prompt, then need no forward at all. Each entry is kept under the LoRA adapter that computed it
    (--lora-per-harness; None without): another adapter's KV is another model's, never a hit."""

    def __init__(self, max_tokens: int = 32768):
        self.max_tokens = max_tokens
        # (adapter, token ids, their KV: [1, H_kv, n, D] keys and values per layer, the logits [V]
        # after the ids or None) entries, the least recently used first
        self.entries = []

    def lookup(
        self, ids: list[int], adapter=None
    ) -> tuple[int, Optional[list], Optional[torch.Tensor]]:
        """What is cached of ``ids`` under ``adapter``: (n, its KV, [1, H_kv, n, D] per layer, the
        logits [V] after it). When all of ``ids`` was stored with its logits, n is ``len(ids)``.
        Else the logits are None and n is the longest cached prefix of 8 tokens or more that leaves
        at least one token to prefill; (0, None, None) when there is none."""
        entries = [entry for entry in self.entries if entry[0] == adapter]
        whole = [entry for entry in entries if entry[3] is not None and entry[1] == ids]
        if whole:
            n = len(ids)
            best = whole[0]
            logits = best[3]
        else:
            lengths = [len(os.path.commonprefix([entry[1], ids[:-1]])) for entry in entries]
            n = max(lengths, default=0)
            if n < 8:
                return 0, None, None
            best = entries[lengths.index(n)]
            logits = None
        # To the end: now the most recently used.
        self.entries = [entry for entry in self.entries if entry is not best] + [best]
        kv = [(keys[:, :, :n], values[:, :, :n]) for keys, values in best[2]]
        return n, kv, logits

    def store(self, ids: list[int], kv: list, adapter=None, logits: Optional[torch.Tensor] = None):
        """Remember the KV of ``ids`` under ``adapter``, and the ``logits`` [V] after them when
        given; the same adapter's entries that are a prefix of ``ids`` become redundant and
        leave."""
        if len(ids) > self.max_tokens:
            return
        self.entries = [
            entry
            for entry in self.entries
            if entry[0] != adapter or ids[: len(entry[1])] != entry[1]
        ]
        self.entries.append((adapter, ids, kv, logits))
        while sum(len(entry[1]) for entry in self.entries) > self.max_tokens:
            # The least recently used leaves.
            self.entries.pop(0)

    def clear(self):
        self.entries.clear()


class RoomyLayer(DynamicLayer):
    """A cache layer whose keys and values are views into buffers with room for 256 more tokens:
    appending writes one column instead of copying the cache, and a row that leaves the batch moves
    the rows after it up within the same buffers. When the batching code replaces the views (it pads
    and trims), the next update copies them into a new buffer once."""

    def update(self, key_states, value_states, *args, **kwargs):
        # [B, H_kv, n, D] cached, [B, H_kv, m, D] new
        n, m = self.keys.shape[-2], key_states.shape[-2]
        buf = getattr(self, "_buf", None)
        # The first update, no room left, or .keys replaced (a new tensor: padded or trimmed): a
        # copy with room for m + 256 more columns.
        if buf is None or buf[0].shape[2] < n + m or buf[0].data_ptr() != self.keys.data_ptr():
            buf = tuple(_with_room(t, n + m + 256) for t in (self.keys, self.values))
            self._buf = buf
        buf[0][:, :, n : n + m] = key_states
        buf[1][:, :, n : n + m] = value_states
        self.keys, self.values = buf[0][:, :, : n + m], buf[1][:, :, : n + m]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor):
        """Keep rows ``indices`` (in order), moved up to the front of the same buffers: a new
        buffer would cost as much memory as the cache, and touching its fresh pages as much time."""
        buf = getattr(self, "_buf", None)
        if buf is None or buf[0].data_ptr() != self.keys.data_ptr():
            return super().batch_select_indices(indices)
        n = self.keys.shape[2]
        for whole, view in zip(buf, (self.keys, self.values)):
            # The kept rows first, copied out: their old and new places may overlap.
            whole[: len(indices), :, :n] = view[indices]
        self._buf = tuple(whole[: len(indices)] for whole in buf)
        self.keys, self.values = self._buf[0][:, :, :n], self._buf[1][:, :, :n]


def _with_room(x: torch.Tensor, columns: int) -> torch.Tensor:
    """[B, H_kv, n, D] -> [B, H_kv, columns, D]: ``x`` in the first n columns, the rest unset (an
    update writes each column before the keys show it)."""
    buf = x.new_empty(x.shape[0], x.shape[1], columns, x.shape[3])
    buf[:, :, : x.shape[2]] = x
    return buf


def batch_cache(cache):
    """The cache a decoding batch keeps, made of its first request's ``cache`` (a DynamicCache): the
    same keys and values, its layers ``RoomyLayer``s."""
    for layer in cache.layers:
        layer.__class__ = RoomyLayer
    return cache


def block_sdpa(query, key, value, mask, scale=None, block: int = 128) -> torch.Tensor:
    """Attention under a boolean ``mask`` [B or 1, 1, L, S], a block of ``block`` query rows at a
    time, each over only the keys that some row of the block sees: the same numbers as
    ``F.scaled_dot_product_attention(query, key, value, mask)`` (a masked key adds exactly 0 to a
    row), in far less time when most of the mask is False. A packed tree's mask
    (``algo.tree_mask``) is: a block of a GRPO group's replies sees their prompt and itself, not the
    other groups, so the cost is L x (block + ancestors), not L^2. The forward and backward of 4
    groups of 8 replies (2,589 packed tokens) took 16 s instead of 26 on a 2-core CPU.

    query [B, H, L, D]; key and value [B, H_kv, S, D], H a multiple of H_kv (grouped query heads
    share a KV head) -> [B, H, L, D]. Every query row must see at least one key.

    For ``algo.pack([[1, 2, 3], [1, 2, 4]])`` (end [4, 4, 3, 4]) at block 2, rows 0-1 attend over
    keys [0, 1], rows 2-3 over [0, 1, 2, 3]; at block 1, row 3 over [0, 1, 3].
    """
    B, H, L, D = query.shape
    H_kv, S = key.shape[1], key.shape[2]
    # a query head h reads KV head h // n_rep (transformers' repeat_kv)
    n_rep = H // H_kv
    n_blocks = -(-L // block)
    # [n_blocks, S]: the keys that any row of each block sees (the mask padded to whole blocks)
    rows = F.pad(mask, (0, 0, 0, n_blocks * block - L))
    seen = rows.view(mask.shape[0], 1, n_blocks, block, S).any(dim=3).any(dim=1).any(dim=0)
    # [K1 + K2 + ...]: block 0's keys, then block 1's, ...; each key's index into the S keys
    keys_of_blocks = seen.nonzero()[:, 1]
    counts = seen.sum(dim=1).tolist()
    # One gather of every block's keys, not one per block: the backward then adds each key's
    # gradient into one zero tensor, not into a zero tensor per block.
    # [B, H_kv, K1 + K2 + ..., D] each
    k = key.index_select(2, keys_of_blocks)
    v = value.index_select(2, keys_of_blocks)
    outs = []
    per_block = zip(
        query.split(block, 2), k.split(counts, 2), v.split(counts, 2), keys_of_blocks.split(counts)
    )
    for i, (q, k_i, v_i, keys_i) in enumerate(per_block):
        n = q.shape[2]
        # The n_rep query heads that share a KV head become that head's rows: [B, H, n, D] ->
        # [B, H_kv, n_rep * n, D], each row under its own row of the mask. Each KV head is read
        # as it is, not repeated n_rep times (and saved so for the backward): 6% less memory and
        # time in SmolLM2's forward and backward of a 2,589-token tree (3 query heads a KV head).
        grouped = q.reshape(B, H_kv, n_rep * n, D)
        # [B or 1, 1, n_rep * n, K_i]: the block's rows of the mask, over its keys, once per head
        mask_i = mask[:, :, i * block : (i + 1) * block][..., keys_i].repeat(1, 1, n_rep, 1)
        out = F.scaled_dot_product_attention(grouped, k_i, v_i, mask_i, scale=scale)
        # (reshape, not view: SDPA may return [B, n_rep * n, H_kv, D] memory, as its query was)
        outs.append(out.reshape(B, H, n, D))
    return torch.cat(outs, dim=2)


# block_sdpa_attention's block of query rows: a forward of fewer rows runs as one SDPA call.
BLOCK_ROWS = 128


def block_sdpa_attention(module, query, key, value, mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' SDPA attention, except that a boolean mask over more than one block of query
    rows on a CPU runs as ``block_sdpa``: the same numbers, each block of rows over the keys
    it sees (a packed tree's mask is mostly False). On a GPU, --attn flex_attention skips the
    blocks instead (its BlockMask)."""
    blocked = mask is not None and mask.dtype == torch.bool and query.shape[2] > BLOCK_ROWS
    # what transformers' SDPA adds to the plain product: dropout, a position bias, a paged cache
    extras = dropout or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
    if not blocked or query.device.type != "cpu" or extras:
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = block_sdpa(query, key, value, mask, scale=scaling, block=BLOCK_ROWS)
    # [B, H, L, D] -> [B, L, H, D], as transformers' attention returns it
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("block_sdpa", block_sdpa_attention)
AttentionMaskInterface.register("block_sdpa", sdpa_mask)


def install_trainer(model):
    """On a CPU, run the trainer's ``model``'s SDPA attention as ``block_sdpa_attention``, once its
    parameters are where it trains (trainer.Learner; extras/fsdp.py's sharded model once filled)."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    if on_cpu and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation("block_sdpa")


def _grouped_sdpa(module, query, key, value, mask, scaling=None, **kwargs):
    """``block_sdpa_attention`` (the trainer's packed trees on a CPU: the backend may serve the
    trainer's own model), except that a decode step (one query token per row) reads each KV head
    once: the query heads that share a KV head are laid out as that head's query positions (all
    rows' positions see the same keys under the same mask), which is exactly attention with
    repeated KV heads."""
    n_rep = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or n_rep == 1:
        return block_sdpa_attention(module, query, key, value, mask, scaling=scaling, **kwargs)
    # query [B, H, 1, D] -> [B, H_kv, n_rep, D]; key and value [B, H_kv, T, D]
    B, H, _, D = query.shape
    grouped = query.reshape(B, H // n_rep, n_rep, D)
    out = F.scaled_dot_product_attention(grouped, key, value, mask, scale=scaling)
    # -> [B, 1, H, D], as transformers' attention returns it
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


AttentionInterface.register("grouped_sdpa", _grouped_sdpa)
AttentionMaskInterface.register("grouped_sdpa", sdpa_mask)


# Up to this many rows (tokens in one forward), a linear layer without gradient runs weight-first.
SKINNY_ROWS = 8


def _skinny_linear(self, x):
    """``nn.Linear.forward``, computed as (W @ x^T)^T when x has few rows, no gradient is taken and
    it runs on a CPU: the same product, in an order MKL runs faster. Its sgemm packs the right-hand
    matrix into panels before it multiplies: with the weights on the right (x @ W^T, as F.linear
    does) a decode step repacks every weight it reads, and SmolLM2's linear layers read their
    0.5 GB at ~5 GB/s where a sum reads 25. Measured on this 2-core machine: all the model's linear
    layers at 8 rows, weights not in cache, 101 -> 62 ms; the embedded backend's decode
    (bench/decode_roofline.py) at batch 2 and 4, 22 -> 27 and 37 -> 50 tokens/s; at 8 within the
    noise, at 16 the same, at 32 and 64 about 7% slower. A single row takes torch's matrix-vector
    path either way."""
    rows = x.numel() // x.shape[-1]
    if torch.is_grad_enabled() or rows > SKINNY_ROWS or x.device.type != "cpu":
        return F.linear(x, self.weight, self.bias)
    # [rows, in] -> [out, rows] -> [rows, out]
    out = (self.weight @ x.reshape(rows, x.shape[-1]).T).T
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


def install(model):
    """Run HFBackend's ``model``'s SDPA (or the trainer's block_sdpa, when it serves the trainer's
    own model) as ``_grouped_sdpa`` (the same attention, decoded faster) and its linear layers as
    ``_skinny_linear``."""
    if model.config._attn_implementation in ("sdpa", "block_sdpa"):
        model.set_attn_implementation("grouped_sdpa")
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = types.MethodType(_skinny_linear, module)


hooks.fast_decode = sys.modules[__name__]

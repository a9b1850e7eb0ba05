"""What the frozen target provides to training: selected layers' hidden states and its final hidden state.

The draft's context features are the raw outputs of the target layers `target_layer_ids`; the target's
distribution `p` at a position is its LM head applied to its final (post-norm) hidden state there. Both come
from one forward pass of the target's decoder:

* **online** (default): [`target_features`] runs the target on every micro-batch. Nothing is written to
  disk; the cost is one target forward per sequence per step.
* **cached**: [`FeatureCache.build`] runs the target once over a dataset and stores both tensors in
  safetensors shards, with the full-vocabulary log-partition at every token (below); later runs (other
  hyper-parameters, baselines, further epochs) read them back instead of running the target. Per token that
  is `(m + 1)·d + 1` values (≈ 14 KB for SmolLM2-135M in fp32, ≈ 30 KB for Qwen3-4B in bf16), so it pays
  off only for repeated runs over the same data.

The LM head is applied only at the positions that are actually trained ([`target_logits`]), never to the
whole `[T, V]` sequence. With a draft vocabulary subset `S` the logits are computed over `S` only, and the
full vocabulary enters through one number per position, its log-partition `log Σ_v exp(z_v)`
([`target_log_partition`]): `p_v = exp(z_v − log Z)` for `v ∈ S` is then the target's *full* distribution
restricted to `S` (it sums to the target's mass on `S`, not to 1), which is what verification compares the
draft with. A feature cache stores that log-partition per token, so a cached run never computes the
full-vocabulary head: on a CPU it is the largest single cost of a step over a subset (see the training guide).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .._transformers import hidden_states_request, model_name, selected_hidden_states
from .data import TokenDataset

# transformers >= 5.23 returns only the requested hidden states (the others as None), which saves memory.
# Format 2 adds the full-vocabulary log-partition per token.
_CACHE_FORMAT = 2


@dataclass
class TargetFeatures:
    """Target outputs for a batch.

    Args:
        context (`torch.Tensor` of shape `(B, T, m·d)`): concatenated raw outputs of the selected layers.
        final (`torch.Tensor` of shape `(B, T, d)`): the final (post-norm) hidden state.
        log_partition (`torch.Tensor` of shape `(B, T)`, *optional*): the LM head's full-vocabulary
            log-partition at every position, where it was computed ahead (a feature cache); else `None`.
    """

    context: torch.Tensor
    final: torch.Tensor
    log_partition: torch.Tensor | None = None


def _decoder(target):
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    return decoder if decoder is not None else getattr(target, target.base_model_prefix)


@torch.no_grad()
def target_features(
    target, layer_ids: list[int], input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> TargetFeatures:
    """Run the target's decoder once and return the selected layers' outputs and the final hidden state.

    Layer `l` is `hidden_states[l + 1]` (entry 0 is the embedding output). The LM head is not applied here.
    """
    out = _decoder(target)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=hidden_states_request(layer_ids),
        use_cache=False,
    )
    context = selected_hidden_states(out.hidden_states, layer_ids)
    return TargetFeatures(context=context, final=out.last_hidden_state)


def target_logits(
    target, final: torch.Tensor, positions: torch.Tensor, vocab_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The target's logits at `positions` (`[B, S]`) from final hidden states `[B, T, d]` → `[B, S, V]`, ≥ fp32.

    With `vocab_ids` (`[K]`) only those columns: `[B, S, K]`. Their softmax would be the target's
    distribution renormalised over the subset, which overstates acceptance; subtract
    [`target_log_partition`] instead to get the full distribution's probabilities on the subset.
    """
    gathered = torch.gather(final, 1, positions[..., None].expand(-1, -1, final.shape[-1]))
    head = target.get_output_embeddings()
    with torch.no_grad():
        if vocab_ids is None:
            logits = head(gathered.to(head.weight.dtype))
        else:
            ids = vocab_ids.to(head.weight.device)
            bias = head.bias[ids] if getattr(head, "bias", None) is not None else None
            logits = torch.nn.functional.linear(gathered.to(head.weight.dtype), head.weight[ids], bias)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


@torch.no_grad()
def target_log_partition(
    target, final: torch.Tensor, positions: torch.Tensor, *, chunk_size: int = 256
) -> torch.Tensor:
    """The target's full-vocabulary log-partition `log Σ_v exp(z_v)` at `positions` (`[B, S]`) → `[B, S]`, fp32.

    Block slots overlap (slot `k` of anchor `a` and slot `k−1` of anchor `a+1` read the same position), so it is
    computed once per distinct `(row, position)`, `chunk_size` positions at a time: the `[chunk_size, V]` logits
    are the largest tensor, never `[B, S, V]`.
    """
    bsz, seq_len, hidden = final.shape
    flat = (torch.arange(bsz, device=positions.device)[:, None] * seq_len + positions).reshape(-1)
    unique, inverse = torch.unique(flat, return_inverse=True)
    rows = final.reshape(bsz * seq_len, hidden)[unique.to(final.device)]
    values = sequence_log_partition(target, rows, chunk_size=chunk_size)
    return values[inverse.to(values.device)].reshape(positions.shape)


def log_partition_at(feats: TargetFeatures, target, positions: torch.Tensor) -> torch.Tensor:
    """The full-vocabulary log-partition at `positions` (`[B, S]`) → `[B, S]`, fp32: read from `feats` where a
    feature cache stored it, else computed ([`target_log_partition`])."""
    if feats.log_partition is None:
        return target_log_partition(target, feats.final, positions)
    return torch.gather(feats.log_partition, 1, positions.to(feats.log_partition.device)).float()


def sequence_log_partition(target, final: torch.Tensor, *, chunk_size: int = 256) -> torch.Tensor:
    """The full-vocabulary log-partition at every row of final hidden states `[T, d]` (one sequence's, or any
    gathered rows) → `[T]`, `chunk_size` rows at a time: the `[chunk_size, V]` logits are the largest tensor."""
    return torch.cat(
        [_log_partition_rows(target, final[i : i + chunk_size]) for i in range(0, final.shape[0], chunk_size)]
    )


def _log_partition_rows(target, rows: torch.Tensor) -> torch.Tensor:
    """`log Σ_v exp(z_v)` of the LM head's logits for final hidden states `rows` (`[n, d]`) → `[n]`, fp32."""
    head = target.get_output_embeddings()
    logits = head(rows.to(head.weight.dtype))
    return torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def pad_features(items: list[tuple[torch.Tensor, ...]], length: int) -> TargetFeatures:
    """Stack per-sequence `(context [T_i, m·d], final [T_i, d])` (optionally with `log_partition [T_i]` third)
    into right-padded batch tensors of `length`."""
    ctx = items[0][0].new_zeros(len(items), length, items[0][0].shape[-1])
    fin = items[0][1].new_zeros(len(items), length, items[0][1].shape[-1])
    with_log_z = all(len(item) > 2 and item[2] is not None for item in items)
    log_z = items[0][0].new_zeros(len(items), length, dtype=torch.float32) if with_log_z else None
    for b, item in enumerate(items):
        c, f = item[0], item[1]
        ctx[b, : c.shape[0]] = c
        fin[b, : f.shape[0]] = f
        if log_z is not None:
            log_z[b, : c.shape[0]] = item[2]
    return TargetFeatures(context=ctx, final=fin, log_partition=log_z)


class FeatureCache:
    """Target features of one dataset on disk: `index.json` plus `shard-NNNNN.safetensors` files.

    Each shard holds `context` `[ΣT, m·d]`, `final` `[ΣT, d]`, `log_partition` `[ΣT]` (the LM head's
    full-vocabulary log-partition at every token, fp32) and `offsets` for `shard_size` consecutive sequences.
    Shards and the index are written atomically (temporary file, then rename), so an interrupted build resumes
    with the shards that are complete. The folder name is a key over the data, the target, the
    layer ids and the dtype, so a changed input never reads stale features.

    Args:
        folder (`str` or `os.PathLike`): a folder written by [`FeatureCache.build`].
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index_path = self.folder / "index.json"
        if not index_path.exists():
            raise FileNotFoundError(f"{self.folder} is not a complete feature cache (no index.json).")
        self.index = json.loads(index_path.read_text())
        self._safe_open = safe_open
        self._handles: dict[int, object] = {}
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self.index["num_sequences"]

    def _shard(self, k: int):
        if k not in self._handles:
            handle = self._safe_open(str(self.folder / f"shard-{k:05d}.safetensors"), framework="pt")
            self._handles[k] = handle
            self._offsets[k] = handle.get_tensor("offsets").tolist()
        return self._handles[k], self._offsets[k]

    def get(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(context [T, m·d], final [T, d], log_partition [T])` of sequence `index` (`log_partition` is `None`
        in a cache of format 1, which did not store it)."""
        k, row = divmod(index, self.index["shard_size"])
        handle, offsets = self._shard(k)
        lo, hi = offsets[row], offsets[row + 1]
        log_z = handle.get_slice("log_partition")[lo:hi] if self.index.get("format", 1) >= 2 else None
        return handle.get_slice("context")[lo:hi], handle.get_slice("final")[lo:hi], log_z

    @staticmethod
    def key(dataset: TokenDataset, target, layer_ids: list[int]) -> str:
        """The sub-folder name identifying (data, target, layers, dtype)."""
        name = model_name(target)
        raw = f"{dataset.fingerprint()}|{name}|{list(layer_ids)}|{target.dtype}|{_CACHE_FORMAT}"
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    @classmethod
    @torch.no_grad()
    def build(
        cls,
        target,
        dataset: TokenDataset,
        layer_ids: list[int],
        root: str | os.PathLike,
        *,
        shard_size: int = 256,
        progress: bool = True,
    ) -> FeatureCache:
        """Compute (or reuse) the cache of `dataset` under `root/<key>/` and open it.

        Sequences are run through the target one at a time (no padding, so the features are exactly the
        ones an online run computes for a batch of one). The full-vocabulary log-partition is computed at every
        token, 256 rows at a time (an online run computes it only at trained positions, in other groups of
        rows: the same values up to float rounding). Runs without autograd, so a target whose weights still
        require grad does not keep every sequence's graph (its `[T, V]` logits among them) until the shard is
        written.
        """
        from safetensors.torch import save_file
        from tqdm.auto import tqdm

        folder = Path(root) / cls.key(dataset, target, layer_ids)
        if (folder / "index.json").exists():
            return cls(folder)
        folder.mkdir(parents=True, exist_ok=True)
        num_shards = (len(dataset) + shard_size - 1) // shard_size
        device = target.device
        bar = tqdm(total=len(dataset), desc="caching target features", disable=not progress, unit="seq")
        for k in range(num_shards):
            rows = range(k * shard_size, min((k + 1) * shard_size, len(dataset)))
            path = folder / f"shard-{k:05d}.safetensors"
            if path.exists():
                bar.update(len(rows))
                continue
            ctx, fin, log_z, offsets = [], [], [], [0]
            for i in rows:
                ids, _ = dataset[i]
                feats = target_features(target, layer_ids, ids[None].to(device))
                ctx.append(feats.context[0].cpu())
                fin.append(feats.final[0].cpu())
                log_z.append(sequence_log_partition(target, feats.final[0]).cpu())
                offsets.append(offsets[-1] + ids.numel())
                bar.update(1)
            tensors = {
                "context": torch.cat(ctx).contiguous(),
                "final": torch.cat(fin).contiguous(),
                "log_partition": torch.cat(log_z).contiguous(),
                "offsets": torch.tensor(offsets, dtype=torch.long),
            }
            _atomic(path, lambda tmp, t=tensors: save_file(t, tmp))
        bar.close()
        index = {
            "format": _CACHE_FORMAT,
            "num_sequences": len(dataset),
            "num_tokens": dataset.num_tokens,
            "shard_size": shard_size,
            "layer_ids": list(layer_ids),
            "target": getattr(target.config, "name_or_path", None) or None,
            "dtype": str(target.dtype),
            "data_fingerprint": dataset.fingerprint(),
        }
        _atomic(folder / "index.json", lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2)))
        return cls(folder)


def _atomic(path: Path, write) -> None:
    """Write `path` through a temporary file in the same folder and an atomic rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

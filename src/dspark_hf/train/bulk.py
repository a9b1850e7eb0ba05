"""A lean batched generator for training data: many sequences at once, bf16 where the CPU has bf16 matrix units.

Training data does not need exactness (a draft learns the target's distribution, and a response sampled in
bf16 is a sample of it up to rounding), so this generator trades the exact kernels' batch invariance for
throughput. Decoding one token for a few hundred sequences is dominated by overhead in `generate()` (a cache
that grows by concatenation, per-module dispatch, padding rows that already finished), not by arithmetic, so
[`BulkGenerator`] keeps what matters lean:

- **fused weights**, one `[q; k; v]` and one `[gate; up]` product per layer, in the generation dtype;
- **preallocated KV**: one key and one value buffer per layer, `[rows, kv_heads, capacity, head_dim]` in the
  generation dtype, written in place and grown 64 positions at a time; a step attends over the whole buffer
  (masked past each row's length), because a contiguous bf16 product is several times faster than one over
  a strided slice;
- **continuous batching**: a row that finishes is refilled from the queue at once (a batched prefill of the
  newcomers), and the live rows are kept at the front of the buffers, so a step costs the live rows only;
- **sampling** from the full softmax at the requested temperature (optionally top-k / top-p) with one seeded
  generator, or greedily.

It runs decoder-only models of the Llama family (Llama, Mistral, Qwen2, Qwen3: RMSNorm, rotary embeddings,
grouped-query attention, a gated MLP), which covers the default target and the common targets; other models
raise [`UnsupportedModelError`] and `prepare-data` falls back to its engine backend.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The target's architecture is not one [`BulkGenerator`] runs."""


def cpu_bf16_capability() -> str | None:
    """The CPU's bf16 matrix support: `"amx"` (AMX tiles), `"avx512_bf16"` (AVX-512 BF16 dot products) or `None`.

    Read from the kernel's CPU flags (Linux); `None` where they cannot be read.
    """
    try:
        flags = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        return None
    names = set(flags.group(1).split()) if flags else set()
    if "amx_bf16" in names:
        return "amx"
    if "avx512_bf16" in names:
        return "avx512_bf16"
    return None


def choose_dtype(requested: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The generation dtype for `requested` (`"auto"`, `"bfloat16"` or `"float32"`) and a line that says why.

    `"auto"` picks bf16 on CUDA and on a CPU with bf16 matrix units (AMX or AVX-512 BF16), else float32.
    """
    if requested not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"generation dtype must be 'auto', 'bfloat16' or 'float32', got {requested!r}.")
    if requested != "auto":
        return getattr(torch, requested), f"{requested} (asked for)"
    if device.type == "cuda":
        return torch.bfloat16, "bfloat16 (CUDA)"
    capability = cpu_bf16_capability()
    if capability is not None:
        return torch.bfloat16, f"bfloat16 (the CPU has {capability} bf16 matrix instructions)"
    return torch.float32, "float32 (this CPU has no bf16 matrix unit, AMX or AVX-512 BF16; bf16 would be slower)"


@dataclass
class _Layer:
    norm1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    norm2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout (the first half of each head pairs with the second)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class BulkGenerator:
    """Generate continuations of many prompts together, as fast as the hardware's matrix units allow.

    Args:
        target (`PreTrainedModel`): a Llama-family causal LM (see [`SUPPORTED_MODEL_TYPES`]); its weights are
            copied once, fused, in `dtype`, and the model itself is not changed.
        max_rows (`int`): sequences decoded together (the KV buffers hold this many; they are allocated by
            [`generate`] for its longest prompt plus `max_new_tokens`, and reused while big enough).
        dtype (`torch.dtype`): the dtype of the weights, activations and KV (logits are sampled in float32).
    """

    def __init__(self, target, max_rows: int, dtype: torch.dtype = torch.bfloat16) -> None:
        config = target.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"The bulk generator runs {', '.join(SUPPORTED_MODEL_TYPES)} models; the target is "
                f"{config.model_type!r}. Use prepare-data's engine backend for it."
            )
        if config.hidden_act != "silu" or getattr(config, "mlp_bias", False):
            raise UnsupportedModelError(f"The bulk generator needs a bias-free SiLU-gated MLP ({config.model_type}).")
        if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
            raise UnsupportedModelError("The bulk generator does not run sliding-window attention.")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}.")
        self.target = target
        self.device = target.device
        self.dtype = dtype
        self.max_rows = max_rows
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.rotary = target.model.rotary_emb
        self.embed = target.model.embed_tokens.weight.detach().to(dtype)
        self.final_norm = target.model.norm.weight.detach().to(dtype)
        self.lm_head = target.lm_head.weight.detach().to(dtype)
        self.layers = [self._fuse(layer) for layer in target.model.layers]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def _reserve(self, capacity: int) -> None:
        """KV buffers with room for `capacity` positions per row: grown (contents kept) in steps of 64."""
        old = self.keys[0].shape[2] if self.keys else 0
        if old >= capacity:
            return
        shape = (self.max_rows, self.num_kv_heads, -(-capacity // 64) * 64, self.head_dim)
        for buffers in (self.keys, self.values):
            for i in range(len(self.layers)):
                # Zeros, not empty: a masked key's weight is 0, and 0 x (NaN garbage in an unwritten slot) is NaN.
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old:
                    grown[:, :, :old] = buffers[i]
                    buffers[i] = grown
                else:
                    buffers.append(grown)

    def _fuse(self, layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp

        def weight(m):
            return m.weight.detach().to(self.dtype)

        biases = [p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases]).to(self.dtype)
        norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return _Layer(
            norm1=weight(layer.input_layernorm),
            qkv=torch.cat([weight(attn.q_proj), weight(attn.k_proj), weight(attn.v_proj)]),
            qkv_bias=bias,
            q_norm=None if norm[0] is None else weight(norm[0]),
            k_norm=None if norm[1] is None else weight(norm[1]),
            o=weight(attn.o_proj),
            norm2=weight(layer.post_attention_layernorm),
            gate_up=torch.cat([weight(mlp.gate_proj), weight(mlp.up_proj)]),
            down=weight(mlp.down_proj),
        )

    # ------------------------------------------------------------------ the forward
    def _attention_inputs(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """`h [rows, t, hidden]` → rotated `q [rows, heads, t, d]`, `k` and `v [rows, kv_heads, t, d]`."""
        rows, t, _ = h.shape
        qkv = F.linear(_rms_norm(h, layer.norm1, self.eps), layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split([self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2], dim=-1)
        q = q.view(rows, t, self.num_heads, self.head_dim)
        k = k.view(rows, t, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q, k = _rms_norm(q, layer.q_norm, self.eps), _rms_norm(k, layer.k_norm, self.eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(rows, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _finish_layer(self, layer: _Layer, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        rows, t = h.shape[:2]
        h = h + F.linear(attended.transpose(1, 2).reshape(rows, t, -1), layer.o)
        gate, up = F.linear(_rms_norm(h, layer.norm2, self.eps), layer.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, layer.down)

    def _rope(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(h, positions)
        return cos.to(self.dtype), sin.to(self.dtype)

    def _prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run `prompts` (right-padded together) into the KV rows `slots`; the logits after each prompt."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)
        positions = torch.arange(width, device=self.device).expand(len(prompts), width)
        h = self.embed[ids]
        cos, sin = self._rope(h, positions)
        index = torch.tensor(slots, device=self.device)
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            q, k, v = self._attention_inputs(layer, h, cos, sin)
            keys[index, :, :width] = k
            values[index, :, :width] = v
            # Right padding: every real query sees only real keys before it, so a causal mask is enough.
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = self._finish_layer(layer, h, attended)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        return self._logits(h[torch.arange(len(prompts)), last])

    def _decode(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One token for the first `len(tokens)` rows, at positions `lengths`; their next-token logits."""
        rows = len(tokens)
        h = self.embed[tokens].unsqueeze(1)
        cos, sin = self._rope(h, lengths.unsqueeze(1))
        arange = torch.arange(rows, device=self.device)
        # -inf on each row's keys past its own length (buffers are shared by rows of different lengths)
        width = self.keys[0].shape[2]
        hidden = (torch.arange(width, device=self.device) > lengths.unsqueeze(1)).view(rows, 1, 1, width)
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            q, k, v = self._attention_inputs(layer, h, cos, sin)
            keys[arange, :, lengths] = k[:, :, 0]
            values[arange, :, lengths] = v[:, :, 0]
            attended = self._decode_attention(q, keys[:rows], values[:rows], hidden)
            h = self._finish_layer(layer, h, attended)
        return self._logits(h[:, 0])

    def _decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor):
        """One query per row over its keys, as two batched products per KV head group (the fused CPU attention
        kernel is several times slower for a single query)."""
        rows, _, _, d = q.shape
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(rows, self.num_kv_heads, group, d)
        scores = torch.matmul(q, keys.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32))
        scores.mul_(d**-0.5)
        probs = scores.masked_fill_(hidden, float("-inf")).softmax(-1).to(self.dtype)
        return torch.matmul(probs, values).view(rows, self.num_heads, 1, d)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(_rms_norm(h, self.final_norm, self.eps), self.lm_head)
        return logits if logits.dtype == torch.float64 else logits.float()

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_ids: list[int],
        *,
        do_sample: bool = True,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        on_tokens=None,
    ) -> list[list[int]]:
        """The continuation of each prompt: sampled (or greedy) tokens, through the first stop token if any.

        Args:
            prompts (`list[list[int]]`): token ids, at least one per prompt.
            max_new_tokens (`int`): the longest continuation.
            stop_ids (`list[int]`): a continuation ends with the first of these (included in it).
            do_sample, temperature, top_k, top_p: the sampling distribution (all of the vocabulary at
                `temperature` unless top-k / top-p narrow it).
            seed (`int`): seeds the one generator all rows sample with.
            on_tokens (`callable`, *optional*): called with the number of tokens each step produced.
        """
        if do_sample and not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}.")
        if max_new_tokens < 1 or any(not p for p in prompts):
            raise ValueError(f"Every prompt needs a token and max_new_tokens must be >= 1, got {max_new_tokens}.")
        if not prompts:
            return []
        generator = torch.Generator(device=self.device).manual_seed(seed)
        stop = set(stop_ids)
        outputs: list[list[int]] = [[] for _ in prompts]
        queue = list(range(len(prompts)))[::-1]  # popped from the end: prompts start in order
        owner: list[int] = []  # owner[r]: the prompt decoded in KV row r; live rows are 0..len(owner)-1
        lengths: list[int] = []  # tokens in row r's KV
        pending: list[int] = []  # row r's last sampled token, not yet in its KV

        def sample(logits: torch.Tensor) -> list[int]:
            if not do_sample:
                return logits.argmax(-1).tolist()
            return _sample(logits / temperature, top_k, top_p, generator).tolist()

        while queue or owner:
            free = self.max_rows - len(owner)
            if queue and free and (free >= max(1, self.max_rows // 8) or not owner):
                joining = [queue.pop() for _ in range(min(free, len(queue)))]
                slots = list(range(len(owner), len(owner) + len(joining)))
                self._reserve(max(len(prompts[i]) for i in joining))
                first = sample(self._prefill(slots, [prompts[i] for i in joining]))
                owner += joining
                lengths += [len(prompts[i]) for i in joining]
                pending += first
                for i, token in zip(joining, first):
                    outputs[i].append(token)
                if on_tokens is not None:
                    on_tokens(len(joining))
            else:
                self._reserve(max(lengths) + 1)
                nxt = sample(
                    self._decode(torch.tensor(pending, device=self.device), torch.tensor(lengths, device=self.device))
                )
                for r, token in enumerate(nxt):
                    outputs[owner[r]].append(token)
                    lengths[r] += 1
                pending = nxt
                if on_tokens is not None:
                    on_tokens(len(nxt))
            self._retire(owner, lengths, pending, outputs, stop, max_new_tokens)
        return outputs

    def _retire(self, owner, lengths, pending, outputs, stop, max_new_tokens) -> None:
        """Drop finished rows, moving the last live row into each freed one so live rows stay at the front."""
        r = 0
        while r < len(owner):
            out = outputs[owner[r]]
            if out[-1] not in stop and len(out) < max_new_tokens:
                r += 1
                continue
            last = len(owner) - 1
            if r != last:
                for keys, values in zip(self.keys, self.values):
                    keys[r, :, : lengths[last]] = keys[last, :, : lengths[last]]
                    values[r, :, : lengths[last]] = values[last, :, : lengths[last]]
                owner[r], lengths[r], pending[r] = owner[last], lengths[last], pending[last]
            owner.pop(), lengths.pop(), pending.pop()


def _sample(logits: torch.Tensor, top_k: int | None, top_p: float | None, generator: torch.Generator) -> torch.Tensor:
    """One token per row from `softmax(logits)`, restricted to the top-k / top-p set when those are given."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # mass of the tokens ranked above
        ordered = ordered.masked_fill(before > top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    # Inverse CDF: one uniform per row against the float64 running sum (torch.multinomial over a 50k vocabulary
    # took longer than the forward itself at 128 rows). A zero-probability token has zero width: never drawn.
    cdf = logits.softmax(-1).double().cumsum_(-1)
    u = torch.rand(len(cdf), 1, dtype=cdf.dtype, device=cdf.device, generator=generator) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)

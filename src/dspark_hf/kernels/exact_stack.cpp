// The second half of the exact kernels (dspark_hf/kernels/build.py compiles it as one source after
// exact_kernels.cpp, whose helpers it calls): a model's lean layers as one call, and a DSpark draft's round.

// ------------------------------------------------------------------------------------------- the layer stack
// A model's lean decoder layers as one call: each layer's attn_in, its keys and values written into the KV
// buffers the caller provides (position `past` onwards), then attn_out over the buffers' first past + L
// positions. The same calls in the same order as calling attn_in / attn_out layer by layer from Python, so the
// results are bit-identical; what goes is the Python between them. A stack's weights are registered once
// (stack_add_layer) and held by reference, so in-place updates of the parameters are seen.
namespace {

struct StackLayer {
  torch::Tensor ln_in;
  double eps_in;
  torch::Tensor wq;
  c10::optional<torch::Tensor> bq;
  torch::Tensor wk;
  c10::optional<torch::Tensor> bk;
  torch::Tensor wv;
  c10::optional<torch::Tensor> bv;
  c10::optional<torch::Tensor> qn_w;
  c10::optional<torch::Tensor> kn_w;
  double q_eps, k_eps;
  int64_t hq, hkv;
  double scale;
  torch::Tensor wo;
  c10::optional<torch::Tensor> bo;
  torch::Tensor ln_post;
  double eps_post;
  torch::Tensor wg;
  c10::optional<torch::Tensor> bg;
  torch::Tensor wu;
  c10::optional<torch::Tensor> bu;
  torch::Tensor wd;
  c10::optional<torch::Tensor> bd;
};

using Stack = std::vector<StackLayer>;
std::mutex stacks_mutex;
std::unordered_map<int64_t, std::shared_ptr<Stack>> stacks;
int64_t next_stack = 1;

std::shared_ptr<Stack> find_stack(int64_t handle) {
  std::lock_guard<std::mutex> lock(stacks_mutex);
  auto it = stacks.find(handle);
  TORCH_CHECK(it != stacks.end(), "exact stack: unknown handle ", handle);
  return it->second;
}

}  // namespace

// Appends a layer to stack `handle` (0: a new stack); returns the stack's handle. The arguments are attn_in's
// weights and constants, the head counts, then attn_out's.
int64_t stack_add_layer(int64_t handle, torch::Tensor ln_in, double eps_in, torch::Tensor wq,
                        c10::optional<torch::Tensor> bq, torch::Tensor wk, c10::optional<torch::Tensor> bk,
                        torch::Tensor wv, c10::optional<torch::Tensor> bv, c10::optional<torch::Tensor> qn_w,
                        c10::optional<torch::Tensor> kn_w, double q_eps, double k_eps, int64_t hq, int64_t hkv,
                        double scale, torch::Tensor wo, c10::optional<torch::Tensor> bo, torch::Tensor ln_post,
                        double eps_post, torch::Tensor wg, c10::optional<torch::Tensor> bg, torch::Tensor wu,
                        c10::optional<torch::Tensor> bu, torch::Tensor wd, c10::optional<torch::Tensor> bd) {
  StackLayer layer{ln_in, eps_in, wq, bq, wk, bk, wv, bv, qn_w, kn_w, q_eps, k_eps, hq, hkv,
                   scale, wo, bo, ln_post, eps_post, wg, bg, wu, bu, wd, bd};
  std::lock_guard<std::mutex> lock(stacks_mutex);
  if (handle == 0) {
    handle = next_stack++;
    stacks[handle] = std::make_shared<Stack>();
  }
  auto it = stacks.find(handle);
  TORCH_CHECK(it != stacks.end(), "exact stack: unknown handle ", handle);
  it->second->push_back(std::move(layer));
  return handle;
}

void stack_free(int64_t handle) {
  std::lock_guard<std::mutex> lock(stacks_mutex);
  stacks.erase(handle);
}

// Runs every layer of stack `handle` on x [B * L, W]. With KV buffers (one keys and one values buffer
// [B, Hkv, capacity, D] per layer, room for past + L positions) each layer appends its keys and values at
// `past` and attends over the first past + L; without them (empty lists) over its own keys and values only.
// Returns [output [B, L, W], keys views..., values views..., outputs of the layers in `record` ([B, L, W])].
// With `bf16` every layer runs attn_in_bf16 / attn_out_bf16 (the linears on the bf16 GEMM), the same calls as the
// lean layers of the exact-bf16 mode make one by one.
std::vector<torch::Tensor> stack_run(int64_t handle, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                     torch::Tensor mask, int64_t batch, int64_t length,
                                     std::vector<torch::Tensor> kbufs, std::vector<torch::Tensor> vbufs,
                                     int64_t past, std::vector<int64_t> record, bool bf16) {
  const std::shared_ptr<Stack> stack = find_stack(handle);
  const Precision precision = bf16 ? Precision::bf16 : Precision::fp32;
  const int64_t n = static_cast<int64_t>(stack->size());
  const bool cached = !kbufs.empty();
  TORCH_CHECK(!cached || (static_cast<int64_t>(kbufs.size()) == n && static_cast<int64_t>(vbufs.size()) == n),
              "exact stack: one keys and one values buffer per layer");
  const int64_t W = x.size(1);
  std::vector<torch::Tensor> out(1 + (cached ? 2 * n : 0));
  for (int64_t i = 0; i < n; ++i) {
    const StackLayer& L = (*stack)[i];
    auto qkv = attn_in_impl(x, L.ln_in, L.eps_in, L.wq, L.bq, L.wk, L.bk, L.wv, L.bv, L.qn_w, L.kn_w, L.q_eps,
                            L.k_eps, cos, sin, batch, length, L.hq, L.hkv, precision);
    torch::Tensor k = qkv[1], v = qkv[2];
    if (cached) {
      TORCH_CHECK(kbufs[i].size(2) >= past + length && vbufs[i].size(2) >= past + length,
                  "exact stack: no room in the KV buffers");
      kbufs[i].narrow(2, past, length).copy_(k);
      vbufs[i].narrow(2, past, length).copy_(v);
      k = kbufs[i].narrow(2, 0, past + length);
      v = vbufs[i].narrow(2, 0, past + length);
      out[1 + i] = k;
      out[1 + n + i] = v;
    }
    x = attn_out_impl(x, qkv[0], k, v, mask, L.scale, L.wo, L.bo, L.ln_post, L.eps_post, L.wg, L.bg, L.wu, L.bu,
                      L.wd, L.bd, precision);
    for (int64_t r : record) {
      if (r == i) out.push_back(x.view({batch, length, W}));
    }
  }
  out[0] = x.view({batch, length, W});
  return out;
}

// Runs every layer of stack `handle` on packed rows x [N, W]: S sequences' new tokens one after another (no
// padding), sequence s being `lens[s]` rows for positions pasts[s] .. pasts[s] + lens[s] - 1 of the sequence held in
// slot `slots[s]` of the per-layer KV buffers kbufs[i] / vbufs[i] ([slots, Hkv, capacity, D], float32, or bfloat16
// with `bf16`: the values attn_in_bf16 rounded, half the bytes to read); cos and sin [N, D] are
// the rows' rotary tables (by position). Each layer runs attn_in on all N rows, writes each sequence's new keys and
// values into its slot at its positions, runs attention_segments (row i of a sequence sees its slot's keys
// 0 .. pasts[s] + i) and the rest of the layer on all N rows. Every operation is per row or per query, so a
// sequence's rows get the bits of the same tokens run alone (stack_run over that sequence, with its cache): how many
// sequences share the call, and which, changes nothing. Returns [output [N, W], outputs of the layers in `record`].
std::vector<torch::Tensor> stack_run_varlen(int64_t handle, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                            std::vector<int64_t> slots, std::vector<int64_t> pasts,
                                            std::vector<int64_t> lens, std::vector<torch::Tensor> kbufs,
                                            std::vector<torch::Tensor> vbufs, std::vector<int64_t> record, bool bf16) {
  const std::shared_ptr<Stack> stack = find_stack(handle);
  const Precision precision = bf16 ? Precision::bf16 : Precision::fp32;
  const int64_t n = static_cast<int64_t>(stack->size());
  TORCH_CHECK(static_cast<int64_t>(kbufs.size()) == n && static_cast<int64_t>(vbufs.size()) == n,
              "exact stack_run_varlen: one keys and one values buffer per layer");
  TORCH_CHECK(x.dim() == 2 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0),
              "exact stack_run_varlen: x [N, W], cos and sin [N, D]");
  const int64_t N = x.size(0), D = cos.size(1), S = static_cast<int64_t>(slots.size());
  const torch::Tensor cos3 = cos.unsqueeze(0), sin3 = sin.unsqueeze(0);
  std::vector<torch::Tensor> out(1);
  std::vector<int64_t> seg_of(N), pos_of(N);  // each packed row's sequence and position
  for (int64_t i = 0; i < n; ++i) {
    const StackLayer& L = (*stack)[i];
    torch::Tensor& kb = kbufs[i];
    torch::Tensor& vb = vbufs[i];
    const bool kv16 = kv_bf16(kb, vb, "exact stack_run_varlen");
    TORCH_CHECK(vb.sizes() == kb.sizes() && kb.dim() == 4 && kb.size(1) == L.hkv && kb.size(3) == D &&
                    kb.stride(3) == 1 && vb.stride(3) == 1,
                "exact stack_run_varlen: KV buffers [slots, Hkv, capacity, D]");
    TORCH_CHECK(!kv16 || bf16, "exact stack_run_varlen: bfloat16 KV buffers are the exact-bf16 mode's");
    auto qkv = attn_in_impl(x, L.ln_in, L.eps_in, L.wq, L.bq, L.wk, L.bk, L.wv, L.bv, L.qn_w, L.kn_w, L.q_eps,
                            L.k_eps, cos3, sin3, 1, N, L.hq, L.hkv, precision);
    // the new keys ([1, Hkv, N, D], contiguous) and values (a [1, Hkv, N, D] view of [N, Hkv, D]) into the slots
    const torch::Tensor k = qkv[1].contiguous(), v = qkv[2][0].transpose(0, 1).contiguous();  // v: [N, Hkv, D]
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    const auto kst = kb.strides(), vst = vb.strides();
    // a row of D values into a buffer: copied into float32, or (already bf16 values) as their bf16 bits
    auto put = [&](const torch::Tensor& buf, int64_t offset, const float* src) {
      if (kv16) {
        kv_bits_row(src, D, reinterpret_cast<uint16_t*>(buf.data_ptr()) + offset);
      } else {
        std::memcpy(buf.data_ptr<float>() + offset, src, D * sizeof(float));
      }
    };
    int64_t row = 0;
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK(0 <= slots[s] && slots[s] < kb.size(0) && pasts[s] >= 0 && pasts[s] + lens[s] <= kb.size(2),
                  "exact stack_run_varlen: no room in the KV buffers");
      for (int64_t t = 0; t < lens[s]; ++t, ++row) {
        seg_of[row] = s;
        pos_of[row] = pasts[s] + t;
      }
    }
    TORCH_CHECK(row == N, "exact stack_run_varlen: the sequences' rows must add up to x's");
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {  // every row's own cells: any split, same bits
      for (int64_t r = begin; r < end; ++r)
        for (int64_t h = 0; h < L.hkv; ++h) {
          const int64_t s = seg_of[r], at = pos_of[r];
          put(kb, slots[s] * kst[0] + h * kst[1] + at * kst[2], kp + (h * N + r) * D);
          put(vb, slots[s] * vst[0] + h * vst[1] + at * vst[2], vp + (r * L.hkv + h) * D);
        }
    });
    const torch::Tensor a = attention_segments(qkv[0], kb, vb, slots, pasts, lens, L.scale);
    x = post_attention(x, a, L.wo, L.bo, L.ln_post, L.eps_post, L.wg, L.bg, L.wu, L.bu, L.wd, L.bd, precision);
    for (int64_t r : record) {
      if (r == i) out.push_back(x);
    }
  }
  out[0] = x;
  return out;
}

// ------------------------------------------------------------------------------------------- the draft's round
// A DSpark draft's drafting round (dspark_hf/decoding/compiled.py) in three calls instead of a few hundred PyTorch
// operations: after the target's forward has streamed its weights through the caches, every PyTorch call of the
// draft starts cold, and that, not the draft's arithmetic, was most of the round's time. The draft's layers are a
// registered stack (stack_add_layer) of Qwen3-style layers; the three calls use the kernels above in the same
// order as the draft's lean PyTorch path, so they compute the same values.

// Appends n context rows to the draft's per-layer KV buffers: ctx = rms_norm(feats fc_w^T (+ fc_b), hn_w), then for
// every layer of stack `handle` the keys rope(k_norm(ctx wk^T (+ bk))) and values ctx wv^T (+ bv) at positions
// length .. length + n - 1, written into kbufs[i] / vbufs[i] ([Hkv, capacity, D]). cos_t / sin_t: [P, D] tables of
// the draft's rotary embedding by position. With `bf16` the linears run on the bf16 GEMM (the exact-bf16 mode).
void draft_ingest(int64_t handle, torch::Tensor feats, torch::Tensor fc_w, c10::optional<torch::Tensor> fc_b,
                  torch::Tensor hn_w, double hn_eps, std::vector<torch::Tensor> kbufs, std::vector<torch::Tensor> vbufs,
                  int64_t length, torch::Tensor cos_t, torch::Tensor sin_t, bool bf16) {
  const std::shared_ptr<Stack> stack = find_stack(handle);
  const Precision precision = bf16 ? Precision::bf16 : Precision::fp32;
  const int64_t n = feats.size(0), layers = static_cast<int64_t>(stack->size());
  TORCH_CHECK(static_cast<int64_t>(kbufs.size()) == layers && static_cast<int64_t>(vbufs.size()) == layers,
              "draft_ingest: one keys and one values buffer per layer");
  if (n == 0) return;
  TORCH_CHECK(feats.scalar_type() == at::kFloat && fc_w.scalar_type() == at::kFloat, "draft_ingest: float32 only");
  feats = feats.contiguous();
  TORCH_CHECK(feats.dim() == 2 && feats.size(1) == fc_w.size(1), "draft_ingest: feats [n, m * W], fc_w [W, m * W]");
  TORCH_CHECK(cos_t.size(0) >= length + n, "draft_ingest: rotary table too short");
  const int64_t W = fc_w.size(0), D = cos_t.size(1);
  auto projected = torch::empty({n, W}, feats.options());
  torch::Tensor keep;
  run_linears(feats.data_ptr<float>(), n, feats.size(1),
              {LinearJob{fc_w, bias_ptr(fc_b, W, keep), nullptr, projected.data_ptr<float>(), W}}, precision);
  const torch::Tensor ctx = rms_norm(projected, hn_w, hn_eps);
  const torch::Tensor cos = cos_t.narrow(0, length, n).unsqueeze(0), sin = sin_t.narrow(0, length, n).unsqueeze(0);
  for (int64_t i = 0; i < layers; ++i) {
    const StackLayer& L = (*stack)[i];
    TORCH_CHECK(kbufs[i].size(1) >= length + n && vbufs[i].size(1) >= length + n, "draft_ingest: no room");
    auto k = torch::empty({n, L.hkv * D}, feats.options());
    auto v = torch::empty({n, L.hkv * D}, feats.options());
    torch::Tensor kb_k, kb_v;
    run_linears(ctx.data_ptr<float>(), n, W,
                {LinearJob{L.wk, bias_ptr(L.bk, L.hkv * D, kb_k), nullptr, k.data_ptr<float>(), L.hkv * D},
                 LinearJob{L.wv, bias_ptr(L.bv, L.hkv * D, kb_v), nullptr, v.data_ptr<float>(), L.hkv * D}},
                precision);
    if (L.kn_w.has_value() && L.kn_w->defined()) k = rms_norm(k.reshape({-1, D}), *L.kn_w, L.k_eps);
    k = rope(k.reshape({1, n, L.hkv * D}), cos, sin, L.hkv);  // [1, Hkv, n, D]
    if (bf16) {  // keys and values at bf16 precision, as attn_in_bf16 holds them
      k = k.contiguous();
      round_to_bf16_(k);
      round_to_bf16_(v);
    }
    kbufs[i].narrow(1, length, n).copy_(k[0]);
    vbufs[i].narrow(1, length, n).copy_(v.view({n, L.hkv, D}).transpose(0, 1));
  }
}

// The draft's block forward: rows [anchor, mask, ..., mask] of the embedding table (G = block rows) at positions
// length .. length + G - 1; per layer attn_in, the block's keys/values written after the context in the buffers
// (scratch space: the caller does not count them), every block row attending to the whole context and the whole
// block (no causal mask), attn_out; then the final norm of the first P rows and the LM head rows head_w [K, W].
// Returns [hidden [P, W], logits [P, K]]. With `bf16` the linears run on the bf16 GEMM (the exact-bf16 mode).
std::vector<torch::Tensor> draft_block_run(int64_t handle, torch::Tensor embed, int64_t anchor, int64_t mask_id,
                                           int64_t G, std::vector<torch::Tensor> kbufs,
                                           std::vector<torch::Tensor> vbufs, int64_t length, torch::Tensor cos_t,
                                           torch::Tensor sin_t, int64_t P, torch::Tensor norm_w, double norm_eps,
                                           torch::Tensor head_w, c10::optional<torch::Tensor> head_b, bool bf16) {
  const std::shared_ptr<Stack> stack = find_stack(handle);
  const Precision precision = bf16 ? Precision::bf16 : Precision::fp32;
  const int64_t layers = static_cast<int64_t>(stack->size());
  TORCH_CHECK(static_cast<int64_t>(kbufs.size()) == layers && static_cast<int64_t>(vbufs.size()) == layers,
              "draft_block_run: one keys and one values buffer per layer");
  TORCH_CHECK(embed.scalar_type() == at::kFloat && embed.dim() == 2 && embed.stride(1) == 1,
              "draft_block_run: embedding table [V, W] float32");
  TORCH_CHECK(0 <= anchor && anchor < embed.size(0) && 0 <= mask_id && mask_id < embed.size(0),
              "draft_block_run: token id out of range");
  TORCH_CHECK(1 <= P && P <= G && cos_t.size(0) >= length + G, "draft_block_run: positions");
  const int64_t W = embed.size(1);
  auto x = torch::empty({G, W}, embed.options());
  for (int64_t r = 0; r < G; ++r) x[r].copy_(embed[r == 0 ? anchor : mask_id]);
  const torch::Tensor cos = cos_t.narrow(0, length, G).unsqueeze(0), sin = sin_t.narrow(0, length, G).unsqueeze(0);
  const torch::Tensor mask = torch::ones({1, 1, 1, length + G}, embed.options().dtype(at::kBool));
  for (int64_t i = 0; i < layers; ++i) {
    const StackLayer& L = (*stack)[i];
    TORCH_CHECK(kbufs[i].size(1) >= length + G && vbufs[i].size(1) >= length + G, "draft_block_run: no room");
    auto qkv = attn_in_impl(x, L.ln_in, L.eps_in, L.wq, L.bq, L.wk, L.bk, L.wv, L.bv, L.qn_w, L.kn_w, L.q_eps,
                            L.k_eps, cos, sin, 1, G, L.hq, L.hkv, precision);
    kbufs[i].narrow(1, length, G).copy_(qkv[1][0]);
    vbufs[i].narrow(1, length, G).copy_(qkv[2][0]);
    const torch::Tensor k = kbufs[i].narrow(1, 0, length + G).unsqueeze(0);
    const torch::Tensor v = vbufs[i].narrow(1, 0, length + G).unsqueeze(0);
    x = attn_out_impl(x, qkv[0], k, v, mask, L.scale, L.wo, L.bo, L.ln_post, L.eps_post, L.wg, L.bg, L.wu, L.bu,
                      L.wd, L.bd, precision);
  }
  const torch::Tensor h = rms_norm(x.narrow(0, 0, P), norm_w, norm_eps);
  TORCH_CHECK(head_w.scalar_type() == at::kFloat && head_w.dim() == 2 && head_w.size(1) == W,
              "draft_block_run: LM head rows [K, W] float32");
  const int64_t K = head_w.size(0);
  auto logits = torch::empty({P, K}, embed.options());
  torch::Tensor keep;
  run_linears(h.data_ptr<float>(), P, W,
              {LinearJob{head_w, bias_ptr(head_b, K, keep), nullptr, logits.data_ptr<float>(), K}}, precision);
  return {h, logits};
}

// The greedy sequential head over P positions: prev = anchor; at position k, e = w1[prev] (the Markov embedding; none
// without a Markov head), logits_j = base[k, j] + dot(e, w2s[j]), the token is ids[j*] for the first maximal j (j*
// itself without a subset), and the confidence logit is dot([hidden[k]; e], conf_w) + conf_b (hidden[k] alone when
// conf_markov is false). The dot products are the linear kernel's. Returns [tokens [P] int64, confidence [P]] (the
// second empty without conf_w). With `bf16` the dot products are the bf16 GEMM's (the exact-bf16 mode).
std::vector<torch::Tensor> markov_greedy(torch::Tensor base, torch::Tensor hidden, int64_t anchor, torch::Tensor w1,
                                         torch::Tensor w2s, torch::Tensor ids, torch::Tensor conf_w,
                                         c10::optional<torch::Tensor> conf_b, bool conf_markov, bool bf16) {
  const Precision precision = bf16 ? Precision::bf16 : Precision::fp32;
  TORCH_CHECK(base.scalar_type() == at::kFloat && base.dim() == 2, "markov_greedy: base logits [P, K] float32");
  base = base.contiguous();
  hidden = hidden.contiguous();
  const int64_t P = base.size(0), K = base.size(1), W = hidden.size(1);
  const bool markov = w1.defined() && w1.numel() > 0;
  const bool subset = ids.defined() && ids.numel() > 0;
  const bool conf = conf_w.defined() && conf_w.numel() > 0;
  int64_t r = 0;
  if (markov) {
    TORCH_CHECK(w1.scalar_type() == at::kFloat && w2s.scalar_type() == at::kFloat && w1.dim() == 2 &&
                    w2s.dim() == 2 && w2s.size(0) == K && w2s.size(1) == w1.size(1),
                "markov_greedy: w1 [V, r], w2s [K, r] float32");
    w1 = w1.contiguous();
    r = w1.size(1);
  }
  TORCH_CHECK(!subset || (ids.scalar_type() == at::kLong && ids.numel() == K), "markov_greedy: ids [K] int64");
  if (subset) ids = ids.contiguous();
  if (conf) {
    TORCH_CHECK(conf_w.scalar_type() == at::kFloat && conf_w.numel() == W + (conf_markov ? r : 0),
                "markov_greedy: confidence weight [W (+ r)]");
    TORCH_CHECK(!conf_markov || markov, "markov_greedy: a Markov confidence feature needs the Markov head");
  }
  auto tokens = torch::empty({P}, base.options().dtype(at::kLong));
  auto confidence = conf ? torch::empty({P}, base.options()) : torch::Tensor();
  std::vector<float> bias(markov ? K : 0), feature(W + r);
  torch::Tensor keep;
  const float* cb = conf ? bias_ptr(conf_b, 1, keep) : nullptr;
  int64_t prev = anchor;
  for (int64_t k = 0; k < P; ++k) {
    const float* e = nullptr;
    if (markov) {
      TORCH_CHECK(0 <= prev && prev < w1.size(0), "markov_greedy: token id out of range");
      e = w1.data_ptr<float>() + prev * r;
      run_linears(e, 1, r, {LinearJob{w2s, nullptr, nullptr, bias.data(), K}}, precision);
    }
    const float* u = base.data_ptr<float>() + k * K;
    int64_t best = 0;
    float top = markov ? u[0] + bias[0] : u[0];
    for (int64_t j = 1; j < K; ++j) {
      const float value = markov ? u[j] + bias[j] : u[j];
      if (value > top) {  // the first maximum, as torch.argmax
        top = value;
        best = j;
      }
    }
    const int64_t token = subset ? ids.data_ptr<int64_t>()[best] : best;
    tokens.data_ptr<int64_t>()[k] = token;
    if (conf) {
      std::memcpy(feature.data(), hidden.data_ptr<float>() + k * W, W * sizeof(float));
      if (conf_markov) std::memcpy(feature.data() + W, e, r * sizeof(float));
      const int64_t width = W + (conf_markov ? r : 0);
      float z;
      run_linears(feature.data(), 1, width, {LinearJob{conf_w, cb, nullptr, &z, 1}}, precision);
      confidence.data_ptr<float>()[k] = z;
    }
    prev = token;
  }
  return {tokens, confidence};
}

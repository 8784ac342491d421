"""Tiny synthetic block-FP8 checkpoints, correct by construction (every merged shard and MoE
intermediate a multiple of 128), for engine_check.py's positive control on several architectures:
Llama, Qwen3-MoE (per-expert and fused HF-v5 ``mlp.experts.gate_up_proj``), MiniMax-M2
(``block_sparse_moe.experts.E.w1/w2/w3``) and DeepSeek-V3 (MLA, shared experts).

    python tests/engines/make_fixtures.py DIR     # writes DIR/{llama,qwen3moe,qwen3moe_fused,minimax_m2,deepseek_v3}

Every one of them passes engine_check at TP 1 with both engines, except where an engine itself
cannot load the layout (SGLang 0.5.23: Llama's block scales, Qwen3-MoE's fused experts).
"""
import json, math, sys
from pathlib import Path
import torch
from safetensors.torch import save_file

g = torch.Generator().manual_seed(0)

def fp8(n, k, e=None):
    shape = (e, n, k) if e else (n, k)
    codes = torch.randint(0, 0x7E, shape, generator=g, dtype=torch.uint8)
    codes |= (torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7)
    sshape = ((e,) if e else ()) + (math.ceil(n / 128), math.ceil(k / 128))
    s = torch.pow(2.0, torch.randint(-12, -4, sshape, generator=g).float())
    return codes.view(torch.float8_e4m3fn), s

def bf16(*shape):
    return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

def lin(t, name, n, k, e=None, fused=False):
    w, s = fp8(n, k, e)
    t[name if fused else name + ".weight"] = w
    t[name + "_scale_inv" if fused else name + ".weight_scale_inv"] = s

QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

def write(d, cfg, t):
    d = Path(d); d.mkdir(parents=True, exist_ok=True)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=1))

def attn(t, p, H, nh, nkv, hd, qknorm=True):
    lin(t, p + ".self_attn.q_proj", nh * hd, H); lin(t, p + ".self_attn.k_proj", nkv * hd, H)
    lin(t, p + ".self_attn.v_proj", nkv * hd, H); lin(t, p + ".self_attn.o_proj", H, nh * hd)
    if qknorm:
        t[p + ".self_attn.q_norm.weight"] = bf16(hd); t[p + ".self_attn.k_norm.weight"] = bf16(hd)
    t[p + ".input_layernorm.weight"] = bf16(H); t[p + ".post_attention_layernorm.weight"] = bf16(H)

def base(t, H, V=256):
    t["model.embed_tokens.weight"] = bf16(V, H); t["lm_head.weight"] = bf16(V, H); t["model.norm.weight"] = bf16(H)

common = dict(vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, torch_dtype="bfloat16",
              tie_word_embeddings=False, hidden_act="silu", bos_token_id=1, eos_token_id=2)

def llama(d):
    H, nh, nkv, hd, I = 256, 2, 2, 128, 256
    t = {}; base(t, H)
    for l in range(2):
        p = f"model.layers.{l}"; attn(t, p, H, nh, nkv, hd, qknorm=False)
        lin(t, p + ".mlp.gate_proj", I, H); lin(t, p + ".mlp.up_proj", I, H); lin(t, p + ".mlp.down_proj", H, I)
    cfg = dict(common, architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H, intermediate_size=I,
               num_hidden_layers=2, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
               quantization_config=dict(QC, ignored_layers=["lm_head"], modules_to_not_convert=["lm_head"]))
    write(d, cfg, t)

def qwen3moe(d, fused):
    H, nh, nkv, hd, I, E = 256, 2, 2, 128, 128, 4
    t = {}; base(t, H)
    for l in range(2):
        p = f"model.layers.{l}"; attn(t, p, H, nh, nkv, hd)
        t[p + ".mlp.gate.weight"] = bf16(E, H)
        if fused:
            lin(t, p + ".mlp.experts.gate_up_proj", 2 * I, H, e=E, fused=True)
            lin(t, p + ".mlp.experts.down_proj", H, I, e=E, fused=True)
        else:
            for e in range(E):
                q = f"{p}.mlp.experts.{e}"
                lin(t, q + ".gate_proj", I, H); lin(t, q + ".up_proj", I, H); lin(t, q + ".down_proj", H, I)
    gates = [f"model.layers.{l}.mlp.gate" for l in range(2)]
    cfg = dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=H, intermediate_size=512,
               moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[], num_hidden_layers=2, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
               attention_bias=False, quantization_config=dict(QC, ignored_layers=["lm_head"] + gates,
                                                              modules_to_not_convert=["lm_head"] + gates))
    write(d, cfg, t)

def minimax(d):
    H, nh, nkv, hd, I, E = 256, 2, 2, 128, 128, 4
    t = {}; base(t, H)
    for l in range(2):
        p = f"model.layers.{l}"; attn(t, p, H, nh, nkv, hd, qknorm=False)
        t[p + ".self_attn.q_norm.weight"] = bf16(nh * hd); t[p + ".self_attn.k_norm.weight"] = bf16(nkv * hd)
        t[p + ".block_sparse_moe.gate.weight"] = bf16(E, H).float()
        t[p + ".block_sparse_moe.e_score_correction_bias"] = torch.zeros(E)
        for e in range(E):
            q = f"{p}.block_sparse_moe.experts.{e}"
            lin(t, q + ".w1", I, H); lin(t, q + ".w3", I, H); lin(t, q + ".w2", H, I)
    gates = [f"model.layers.{l}.block_sparse_moe.gate" for l in range(2)]
    cfg = dict(common, architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", hidden_size=H, intermediate_size=I,
               num_local_experts=E, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=nh,
               num_key_value_heads=nkv, head_dim=hd, rotary_dim=64, partial_rotary_factor=0.5, use_qk_norm=True, qk_norm_type="per_layer",
               scoring_func="sigmoid", use_routing_bias=True, quantization_config=dict(QC, ignored_layers=["lm_head"] + gates,
                                                                                   modules_to_not_convert=["lm_head"] + gates))
    write(d, cfg, t)

def deepseek(d):
    H, nh, qlr, kvlr, nope, rope, vd, I, MI, E = 256, 2, 128, 128, 128, 64, 128, 256, 128, 4
    t = {}; base(t, H)
    for l in range(2):
        p = f"model.layers.{l}"
        lin(t, p + ".self_attn.q_a_proj", qlr, H); t[p + ".self_attn.q_a_layernorm.weight"] = bf16(qlr)
        lin(t, p + ".self_attn.q_b_proj", nh * (nope + rope), qlr)
        lin(t, p + ".self_attn.kv_a_proj_with_mqa", kvlr + rope, H); t[p + ".self_attn.kv_a_layernorm.weight"] = bf16(kvlr)
        lin(t, p + ".self_attn.kv_b_proj", nh * (nope + vd), kvlr)
        lin(t, p + ".self_attn.o_proj", H, nh * vd)
        t[p + ".input_layernorm.weight"] = bf16(H); t[p + ".post_attention_layernorm.weight"] = bf16(H)
        if l == 0:
            lin(t, p + ".mlp.gate_proj", I, H); lin(t, p + ".mlp.up_proj", I, H); lin(t, p + ".mlp.down_proj", H, I)
        else:
            t[p + ".mlp.gate.weight"] = bf16(E, H); t[p + ".mlp.gate.e_score_correction_bias"] = torch.zeros(E)
            for e in range(E):
                q = f"{p}.mlp.experts.{e}"
                lin(t, q + ".gate_proj", MI, H); lin(t, q + ".up_proj", MI, H); lin(t, q + ".down_proj", H, MI)
            q = f"{p}.mlp.shared_experts"
            lin(t, q + ".gate_proj", MI, H); lin(t, q + ".up_proj", MI, H); lin(t, q + ".down_proj", H, MI)
    cfg = dict(common, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=H, intermediate_size=I,
               moe_intermediate_size=MI, n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
               moe_layer_freq=1, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
               routed_scaling_factor=1.0, num_hidden_layers=2, num_attention_heads=nh, num_key_value_heads=nh,
               q_lora_rank=qlr, kv_lora_rank=kvlr, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=vd,
               rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 128}, attention_bias=False,
               quantization_config=dict(QC, ignored_layers=["lm_head"], modules_to_not_convert=["lm_head"]))
    write(d, cfg, t)

out = Path(sys.argv[1])
llama(out / "llama"); qwen3moe(out / "qwen3moe", False); qwen3moe(out / "qwen3moe_fused", True)
minimax(out / "minimax_m2"); deepseek(out / "deepseek_v3")
print("ok")

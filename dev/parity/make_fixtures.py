#!/usr/bin/env python3
"""
make_fixtures.py -- reference fixtures for the C parity test (llmc/tests/test_parity.c).

Builds two tiny random-init HF models (LLaMA-3 with llama3 RoPE scaling, untied head; Qwen3 with
QK-norm, head_dim != hidden/heads, tied head) in fp32 on the CPU with eager attention, and records
for one fixed batch: the loss, the gradient of every trainable parameter, and the loss trajectory
of 8 AdamW steps with global-norm clipping. Output, per model, under fixtures/<name>/:

    config.json, model.safetensors   (save_pretrained, fp32)
    expected.safetensors             tokens, loss, grad.<hf name>, traj_loss, traj_grad_norm,
                                     hyper-parameters and versions in __metadata__

Invariants: everything is fp32 on the CPU, deterministic algorithms, one thread, fixed seeds; the
loss is the plain mean cross-entropy over all B*T positions (inputs = tokens[:, :T],
targets = tokens[:, 1:]), NOT HF's labels path (which shifts again and drops a position).

This script is a development tool (dev/): it is never on the training path. It does not need CUDA.

Usage:  python3 dev/parity/make_fixtures.py [--out DIR]
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

# ----------------------------------------------------------------------------
# fixed settings (the C test reads the hyper-parameters back from __metadata__)

B = 2
T = 16
LR = 1e-2
BETA1 = 0.9
BETA2 = 0.95
EPS = 1e-8
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
TRAJ_STEPS = 8
NORM_NOISE = 0.1     # norm weights = 1 + NORM_NOISE * randn, so their gradients are exercised
SIZE_BUDGET = 400 * 1024

DECAY_NOTE = (
    "torch.optim.AdamW, constant lr, two param groups: weight_decay applied only to parameters "
    "with ndim >= 2 other than the token embedding model.embed_tokens.weight (so lm_head.weight of "
    "an untied model IS decayed; norm weights and the embedding are not, and a tied head is the "
    "embedding, so it is not decayed). Before every step: "
    "torch.nn.utils.clip_grad_norm_(all params, max_norm=grad_clip), i.e. grads scaled by "
    "min(1, grad_clip/(global_l2_norm+1e-6)). traj_loss[k] is the loss before update k+1 "
    "(traj_loss[0] == loss); traj_grad_norm[k] is the unclipped global grad norm at that point. "
    "Loss = mean over all B*T positions of cross_entropy(logits.float(), targets), "
    "inputs = tokens[:, :T], targets = tokens[:, 1:]."
)


def llama_spec():
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        max_position_embeddings=512, rope_parameters=rope, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, attention_dropout=0.0, hidden_act="silu",
        bos_token_id=1, eos_token_id=2, pad_token_id=None, dtype="float32",
        attn_implementation="eager",
    )
    return "llama", cfg, LlamaForCausalLM, 1001, 0.5


def qwen3_spec():
    cfg = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True, attention_bias=False, attention_dropout=0.0, hidden_act="silu",
        use_sliding_window=False, sliding_window=None, bos_token_id=1, eos_token_id=2,
        pad_token_id=None, dtype="float32", attn_implementation="eager",
    )
    # The head is the embedding here: with std 0.5 the own-token logit would be ~|e|^2/0.5 ~ 32.
    return "qwen3", cfg, Qwen3ForCausalLM, 2002, 0.1


# ----------------------------------------------------------------------------
# reference formulas used to check that the config really is what it claims to be


def ref_inv_freq(theta, hd):
    # Same expression order as HF (int64 arange -> fp32 -> pow), computed in fp32.
    exps = torch.arange(0, hd, 2, dtype=torch.int64).to(torch.float32) / hd
    return 1.0 / (theta ** exps)


def ref_llama3_inv_freq(theta, hd, factor, lf, hf, l0):
    # Computed independently in float64, compared to HF's fp32 result with a tolerance.
    out = []
    regimes = []
    lam_lo = l0 / lf
    lam_hi = l0 / hf
    for i in range(hd // 2):
        inv = theta ** (-2.0 * i / hd)
        lam = 2.0 * math.pi / inv
        if lam < lam_hi:
            out.append(inv)
            regimes.append("keep")
        elif lam > lam_lo:
            out.append(inv / factor)
            regimes.append("div")
        else:
            s = (l0 / lam - lf) / (hf - lf)
            out.append((1.0 - s) * inv / factor + s * inv)
            regimes.append("blend")
    return torch.tensor(out, dtype=torch.float64), regimes


def check_model(name, model, cfg):
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == cfg.tie_word_embeddings, f"{name}: tied={tied}, wanted {cfg.tie_word_embeddings}"
    names = [n for n, _ in model.named_parameters()]
    assert ("lm_head.weight" in names) == (not cfg.tie_word_embeddings), names

    rotary = model.model.rotary_emb
    inv = rotary.inv_freq.detach().to(torch.float32)
    hd = cfg.head_dim
    assert inv.shape == (hd // 2,), inv.shape
    assert float(rotary.attention_scaling) == 1.0, rotary.attention_scaling
    rp = cfg.rope_parameters
    if rp["rope_type"] == "llama3":
        want, regimes = ref_llama3_inv_freq(rp["rope_theta"], hd, rp["factor"], rp["low_freq_factor"],
                                            rp["high_freq_factor"], rp["original_max_position_embeddings"])
        err = ((inv.double() - want).abs() / want).max().item()
        assert err < 1e-6, f"{name}: llama3 inv_freq mismatch, max rel err {err}"
        plain = ref_inv_freq(rp["rope_theta"], hd)
        assert not torch.allclose(inv, plain), f"{name}: llama3 scaling not active"
        for r in ("keep", "blend", "div"):
            assert r in regimes, f"{name}: llama3 regime {r} does not occur with head_dim {hd}"
        print(f"  rope llama3 active: regimes {regimes}, max rel err vs formula {err:.2e}")
    else:
        want = ref_inv_freq(rp["rope_theta"], hd)
        assert torch.equal(inv, want), f"{name}: default inv_freq mismatch"
        print(f"  rope default theta {rp['rope_theta']:g}, hd {hd}: inv_freq matches")
    print(f"  inv_freq {[f'{v:.6e}' for v in inv.tolist()]}")
    print(f"  tied={tied} params={sum(p.numel() for p in model.parameters())}")


# ----------------------------------------------------------------------------
# model construction, loss, trajectory


def build_model(cfg, cls, seed, embed_std):
    torch.manual_seed(seed)
    model = cls(cfg).to(device="cpu", dtype=torch.float32)
    # Re-initialise in place (keeps a tied head tied) from a dedicated generator.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.randn(emb.shape, generator=gen) * embed_std)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):  # input_layernorm, post_attention_layernorm, q_norm, k_norm, norm
                p.copy_(1.0 + NORM_NOISE * torch.randn(p.shape, generator=gen))
    n_norms = sum(1 for n, _ in model.named_parameters() if n.endswith("norm.weight"))
    per_layer = 4 if cfg.model_type == "qwen3" else 2
    assert n_norms == per_layer * cfg.num_hidden_layers + 1, n_norms
    model.train()  # dropout is 0 everywhere, so train/eval give the same numbers
    return model


def compute_loss(model, inputs, targets):
    logits = model(input_ids=inputs.long()).logits
    if logits.dtype != torch.float64:  # the fp64 cross-check keeps its precision
        logits = logits.float()
    v = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, v), targets.long().reshape(-1), reduction="mean")


def run_trajectory(model, inputs, targets, verbose=True):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.ndim >= 2 and n != "model.embed_tokens.weight":
            decay.append(p)
        else:
            no_decay.append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=(BETA1, BETA2), eps=EPS, foreach=False, fused=False,
    )
    params = list(model.parameters())
    losses, norms = [], []
    for k in range(TRAJ_STEPS):
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(model, inputs, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=GRAD_CLIP)
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
        clipped = "clipped" if norm.item() > GRAD_CLIP else "not clipped"
        if verbose:
            print(f"  step {k + 1}: loss {loss.item():.7f}  grad norm {norm.item():.6f} ({clipped})")
    return losses, norms


# ----------------------------------------------------------------------------
# one fixture


def make_fixture(spec, out_root):
    name, cfg, cls, seed, embed_std = spec
    print(f"== {name}")
    out = os.path.join(out_root, name)
    os.makedirs(out, exist_ok=True)
    model = build_model(cfg, cls, seed, embed_std)
    check_model(name, model, cfg)

    gen = torch.Generator().manual_seed(seed + 2)
    tokens = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=gen, dtype=torch.int64).to(torch.int32)
    inputs, targets = tokens[:, :T], tokens[:, 1:]

    # Save the initial weights before anything touches them.
    model.save_pretrained(out)
    for stale in ("generation_config.json",):
        path = os.path.join(out, stale)
        if os.path.exists(path):
            os.remove(path)
    sd = {n: p.detach().clone() for n, p in model.state_dict().items()}

    model.zero_grad(set_to_none=True)
    loss = compute_loss(model, inputs, targets)
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        grads["grad." + n] = p.grad.detach().clone().contiguous()
    print(f"  loss {loss.item():.7f}  (ln V = {math.log(cfg.vocab_size):.4f})")
    for n, g in grads.items():
        print(f"  |{n}| = {g.norm().item():.6e}")

    traj, traj_norms = run_trajectory(model, inputs, targets)
    assert traj[0] == loss.item(), (traj[0], loss.item())
    f64 = cross_check_f64(out, inputs, targets, loss.item(), grads, traj)

    tensors = {
        "tokens": tokens.contiguous(),
        "loss": loss.detach().reshape(1).to(torch.float32),
        "traj_loss": torch.tensor(traj, dtype=torch.float32),
        "traj_grad_norm": torch.tensor(traj_norms, dtype=torch.float32),
    }
    tensors.update(grads)
    meta = {
        "model": name,
        "lr": repr(LR), "beta1": repr(BETA1), "beta2": repr(BETA2), "eps": repr(EPS),
        "weight_decay": repr(WEIGHT_DECAY), "grad_clip": repr(GRAD_CLIP),
        "B": str(B), "T": str(T), "steps": str(TRAJ_STEPS),
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "embed_std": repr(embed_std), "norm_noise": repr(NORM_NOISE),
        "note": DECAY_NOTE,
    }
    meta.update(f64)
    save_file(tensors, os.path.join(out, "expected.safetensors"), metadata=meta)

    verify_fixture(name, out, cfg, cls, sd, inputs, targets, loss.item())
    return traj


def cross_check_f64(out, inputs, targets, loss, grads, traj):
    # The same computation in fp64 from the saved weights: how far an exact implementation sits
    # from this fp32 reference, i.e. the floor under the C test's tolerances.
    m = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float64)
    m.train()
    l64 = compute_loss(m, inputs, targets)
    l64.backward()
    worst = 0.0
    for n, p in m.named_parameters():
        g32 = grads["grad." + n].double()
        worst = max(worst, ((p.grad - g32).norm() / g32.norm().clamp_min(1e-30)).item())
    m.zero_grad(set_to_none=True)
    t64, _ = run_trajectory(m, inputs, targets, verbose=False)
    loss_rel = abs(l64.item() - loss) / abs(l64.item())
    traj_abs = max(abs(a - b) for a, b in zip(t64, traj))
    print(f"  fp64 cross-check: loss rel err {loss_rel:.2e}, worst grad rel L2 err {worst:.2e}, "
          f"traj max abs err {traj_abs:.2e}")
    return {"f64_loss_rel_err": f"{loss_rel:.3e}", "f64_grad_max_rel_l2_err": f"{worst:.3e}",
            "f64_traj_max_abs_err": f"{traj_abs:.3e}"}


def verify_fixture(name, out, cfg, cls, sd, inputs, targets, loss):
    # model.safetensors: every tensor fp32, exactly the initial weights, no head when tied.
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for k in keys:
            t = f.get_tensor(k)
            assert t.dtype == torch.float32, (k, t.dtype)
            assert torch.equal(t, sd[k]), k
    want = set(sd.keys())
    if cfg.tie_word_embeddings:
        want.discard("lm_head.weight")
        assert "lm_head.weight" not in keys
    assert keys == want, sorted(keys ^ want)

    # config.json round trip: a fresh load must reproduce the loss bit for bit.
    with open(os.path.join(out, "config.json")) as f:
        cj = json.load(f)
    print(f"  config.json: tie_word_embeddings={cj.get('tie_word_embeddings')} "
          f"rope={cj.get('rope_parameters', cj.get('rope_scaling'))}")
    again = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert isinstance(again, cls)
    with torch.no_grad():
        l2 = compute_loss(again, inputs, targets).item()
    assert l2 == loss, f"{name}: reloaded loss {l2} != {loss}"

    total = 0
    for fn in sorted(os.listdir(out)):
        sz = os.path.getsize(os.path.join(out, fn))
        total += sz
        print(f"  {fn}: {sz} bytes")
    note = "" if total < SIZE_BUDGET else f" (over the {SIZE_BUDGET} byte budget: shapes are fixed by the spec)"
    print(f"  total {total} bytes{note}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    print(f"torch {torch.__version__}  transformers {transformers.__version__}  python {sys.version.split()[0]}")

    summary = {}
    for spec in (llama_spec(), qwen3_spec()):
        summary[spec[0]] = make_fixture(spec, args.out)
    print("== trajectories")
    for name, traj in summary.items():
        print(f"  {name}: " + " ".join(f"{v:.5f}" for v in traj))


if __name__ == "__main__":
    main()

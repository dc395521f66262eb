#!/usr/bin/env python3
"""
make_lora_fixtures.py -- PEFT LoRA reference fixtures for the C test llmc/tests/test_lora.c
(suite `lora`, tests lora_parity_qwen3 and lora_parity_llama), and the reverse check: PEFT's loss
of an adapter directory written by ./train_roundpipe --export-lora.

Builds the two tiny random-init base models of make_fixtures.py (LLaMA-3 with llama3 RoPE
scaling, untied head; Qwen3 with QK-norm and a tied head), wraps each in a PEFT LoRA model and
sets every lora_B to random values (PEFT initialises B to zero, which would make the adapters'
gradients of A vanish and the adapted loss equal the base's), then records for one fixed batch
PEFT's loss, logits and the gradient of every adapter tensor. Output, per model, under
fixtures/lora_<name>/:

    config.json, model.safetensors     the base (save_pretrained, fp32)
    adapter/                           the adapter (PeftModel.save_pretrained: adapter_config.json,
                                       adapter_model.safetensors, fp32)
    expected.safetensors               tokens I32 [B, T+1], loss F32 [1], logits F32 [B, T, V],
                                       grad.<PEFT key> F32 (key as in adapter_model.safetensors);
                                       __metadata__: lora_r, lora_alpha, lora_targets (the
                                       --lora-targets value), use_rslora ("true"/"false"), versions
    tokens.bin                         the batch as an llm.c token shard (uint16): with
                                       --train tokens.bin --batch B --seq T the trainer's first batch

The adapters: qwen3 r 4, alpha 8, all-linear; llama r 8, alpha 16, q/v/o/up/down with rsLoRA.

A third fixture, lora_qwen3moe (test lora_parity_qwen3moe): the tiny Qwen3-MoE of
make_moe_fixtures.py (8 experts, top-2, a dense middle block, the aux loss on) with r 4, alpha 8,
all-linear, rsLoRA. On transformers 5 its experts are fused 3-D parameters: PEFT turns all-linear
into target_modules q/k/v/o_proj plus target_parameters gate.weight (the router), gate_up_proj
(rank 2r, alpha 2 alpha through rank_pattern / alpha_pattern) and down_proj, one ParamWrapper per
parameter on mlp.experts (keys mlp.experts.base_layer.lora_A/B and mlp.experts.lora_A/B, lora_A
(rank*E, in), lora_B (out, rank*E)); the dense block's MLP gets no adapter. The script prints the
adapter_config.json PEFT wrote and checks those keys and shapes. Its loss is cross-entropy +
router_aux_loss_coef * aux (as make_moe_fixtures.py and the C trainer), with every routing
decision at least MIN_ROUTE_GAP from a tie in the adapted router logits.
lora_dropout 0 (PEFT's dropout draws from torch's generator: not reproducible in C).
Loss = mean over all B*T positions of cross_entropy(logits.float(), targets), inputs =
tokens[:, :T], targets = tokens[:, 1:] (as make_fixtures.py).

Usage:
    python3 dev/parity/make_lora_fixtures.py [--out DIR]
        writes the fixtures
    python3 dev/parity/make_lora_fixtures.py --peft-loss ADAPTER_DIR --fixture lora_qwen3
                                             [--expect LOSS]
        (--fixture lora_qwen3moe: the MoE loss, with the aux term)
        PEFT's loss (and the loss of the fixture's own adapter) of ADAPTER_DIR on the fixture's
        base and batch; with --expect, exit 1 unless |PEFT - LOSS| <= 1e-5 * |LOSS|. Compare with
        ours: ./train_roundpipe --model FIX --lora-r R --lora-alpha A [--lora-targets L]
        [--rslora] --lora-init ADAPTER_DIR --train FIX/tokens.bin --batch B --seq T --val ''
        --dump-state /tmp/d.safetensors   (prints "loss X")

This script is a development tool (dev/): never on the training path. It needs torch,
transformers, peft and safetensors; no CUDA.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import B, T, build_model, check_model, compute_loss, llama_spec, qwen3_spec  # noqa: E402

import peft  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

B_STD = 0.1  # lora_B ~ N(0, B_STD): adapters that change the loss, gradients of A non-zero

ADAPTERS = {
    "qwen3": dict(r=4, lora_alpha=8, target_modules="all-linear", use_rslora=False,
                  flag="all-linear"),
    "llama": dict(r=8, lora_alpha=16,
                  target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                  use_rslora=True, flag="q,v,o,up,down"),
}


def peft_key(name):
    # "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" -> saved key
    return name.replace(".default", "")


# ----------------------------------------------------------------------------
# the Qwen3-MoE fixture (per-expert adapters through target_parameters)

MOE_ADAPTER = dict(r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True,
                   flag="all-linear")
MIN_ROUTE_GAP = 1e-3  # top-K margin of every routing decision in the adapted router logits
MOE_SEED_TRIES = 8


def moe_loss(model, inputs, targets):
    """(loss, logits): cross-entropy + router_aux_loss_coef * aux, as the C trainer's MoE loss."""
    out = model(input_ids=inputs.long(), output_router_logits=True)
    logits = out.logits.float()
    v = logits.shape[-1]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, v), targets.long().reshape(-1))
    assert out.aux_loss is not None, "no aux_loss: output_router_logits was not honoured"
    return ce + model.config.router_aux_loss_coef * out.aux_loss.to(ce.dtype), logits


def router_gap(pm, inputs, n_experts, top_k):
    """The smallest top-K margin of the adapted router logits over all tokens and MoE blocks."""
    gaps = []

    def hook(module, args, output):
        outs = output if isinstance(output, (tuple, list)) else (output,)
        logits = next(o for o in outs if torch.is_tensor(o) and o.shape[-1] == n_experts)
        srt = logits.detach().reshape(-1, n_experts).double().sort(dim=-1, descending=True).values
        gaps.append((srt[:, top_k - 1] - srt[:, top_k]).min().item())

    handles = [m.register_forward_hook(hook) for n, m in pm.named_modules()
               if n.endswith("mlp.gate")]
    assert handles, "no router module (mlp.gate) found"
    with torch.no_grad():
        pm(input_ids=inputs.long(), output_router_logits=True)
    for h in handles:
        h.remove()
    return min(gaps)


def check_moe_adapter(adapter_dir, cfg, r):
    """The keys and shapes PEFT wrote for the experts (the C side reads exactly these)."""
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        ac = json.load(f)
    print(f"  adapter_config.json: {ac}")
    E, C, Fe = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    want = {"base_layer.lora_A": (2 * r * E, C), "base_layer.lora_B": (2 * Fe, 2 * r * E),
            "lora_A": (r * E, Fe), "lora_B": (C, r * E)}
    with safe_open(os.path.join(adapter_dir, "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        n = 0
        for k in keys:
            if ".mlp.experts." not in k:
                continue
            tail = k.split(".mlp.experts.", 1)[1][:-len(".weight")]
            shape = tuple(f.get_slice(k).get_shape())
            assert tail in want and shape == want[tail], (k, shape, want.get(tail))
            n += 1
    assert n > 0, "no expert adapter in the file: PEFT did not adapt the experts"
    print(f"  {n} expert adapter tensors with the expected keys and shapes")


def make_moe_fixture(out_root):
    import make_moe_fixtures as mm  # noqa: E402 -- the tiny Qwen3-MoE and its helpers

    spec = mm.qwen3moe_spec()
    cfg = spec["cfg"]
    ad = MOE_ADAPTER
    name = "lora_qwen3moe"
    print(f"== {name}: r {ad['r']}, alpha {ad['lora_alpha']}, {ad['target_modules']}, "
          f"rslora {ad['use_rslora']}")
    out = os.path.join(out_root, name)
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(spec["seed"] + 2)
    tokens = torch.randint(0, cfg.vocab_size, (mm.B, mm.T + 1), generator=gen,
                           dtype=torch.int64).to(torch.int32)
    inputs, targets = tokens[:, :mm.T], tokens[:, 1:]
    pm = None
    for k in range(MOE_SEED_TRIES):
        seed = spec["seed"] + 1000 * k
        model = mm.build_model(spec, seed)
        model.save_pretrained(out)
        torch.manual_seed(seed + 3)
        lc = LoraConfig(r=ad["r"], lora_alpha=ad["lora_alpha"],
                        target_modules=ad["target_modules"], lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM", use_rslora=ad["use_rslora"])
        cand = get_peft_model(model, lc)
        bgen = torch.Generator().manual_seed(seed + 4)
        with torch.no_grad():
            for n, p in cand.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=bgen) * B_STD)
        gap = router_gap(cand, inputs, cfg.num_experts, cfg.num_experts_per_tok)
        if gap >= MIN_ROUTE_GAP:
            pm = cand
            print(f"  seed {seed}: top-{cfg.num_experts_per_tok} margin {gap:.2e}")
            break
        print(f"  seed {seed}: top-K margin {gap:.2e} < {MIN_ROUTE_GAP}: next seed")
    assert pm is not None, f"no seed of {MOE_SEED_TRIES} gives routing margins >= {MIN_ROUTE_GAP}"
    stale = os.path.join(out, "generation_config.json")
    if os.path.exists(stale):
        os.remove(stale)
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    pm.train()
    pm.save_pretrained(os.path.join(out, "adapter"))
    check_moe_adapter(os.path.join(out, "adapter"), cfg, ad["r"])

    pm.zero_grad(set_to_none=True)
    loss, logits = moe_loss(pm, inputs, targets)
    loss.backward()
    grads = {"grad." + peft_key(n): p.grad.detach().clone().contiguous()
             for n, p in pm.named_parameters() if p.requires_grad}
    print(f"  loss {loss.item():.7f}, {len(grads)} adapter gradients")
    with safe_open(os.path.join(out, "adapter", "adapter_model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    assert saved == {k[len("grad."):] for k in grads}, sorted(saved ^ {k[5:] for k in grads})

    tensors = {"tokens": tokens.contiguous(), "loss": loss.detach().reshape(1).float(),
               "logits": logits.detach().contiguous()}
    tensors.update(grads)
    meta = {"model": name, "B": str(mm.B), "T": str(mm.T), "lora_r": str(ad["r"]),
            "lora_alpha": repr(float(ad["lora_alpha"])), "lora_targets": ad["flag"],
            "use_rslora": "true" if ad["use_rslora"] else "false", "lora_dropout": "0.0",
            "b_std": repr(B_STD), "aux_coef": repr(cfg.router_aux_loss_coef),
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__, "peft_version": peft.__version__}
    save_file(tensors, os.path.join(out, "expected.safetensors"), metadata=meta)
    write_shard(os.path.join(out, "tokens.bin"), tokens)
    again = peft_loss(out, os.path.join(out, "adapter"), inputs, targets)
    assert abs(again - loss.item()) <= 1e-6 * abs(loss.item()), (again, loss.item())
    for fn in sorted(os.listdir(out)):
        print(f"  {fn}")


def write_shard(path, tokens):
    # llm.c shard: 256 int32 header (magic 20240520, version 1, token count), uint16 tokens
    flat = tokens.reshape(-1).to(torch.int64).numpy()
    assert flat.max() < 65536
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, flat.size
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(flat.astype(np.uint16).tobytes())


def make_fixture(spec, out_root):
    name, cfg, cls, seed, embed_std = spec
    ad = ADAPTERS[name]
    print(f"== lora_{name}: r {ad['r']}, alpha {ad['lora_alpha']}, targets {ad['target_modules']}, "
          f"rslora {ad['use_rslora']}")
    out = os.path.join(out_root, f"lora_{name}")
    os.makedirs(out, exist_ok=True)
    model = build_model(cfg, cls, seed, embed_std)
    check_model(name, model, cfg)
    model.save_pretrained(out)
    stale = os.path.join(out, "generation_config.json")
    if os.path.exists(stale):
        os.remove(stale)

    gen = torch.Generator().manual_seed(seed + 2)
    tokens = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=gen, dtype=torch.int64).to(torch.int32)
    inputs, targets = tokens[:, :T], tokens[:, 1:]

    torch.manual_seed(seed + 3)  # PEFT's kaiming init of A draws from torch's default generator
    lc = LoraConfig(r=ad["r"], lora_alpha=ad["lora_alpha"], target_modules=ad["target_modules"],
                    lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                    use_rslora=ad["use_rslora"])
    pm = get_peft_model(model, lc)
    bgen = torch.Generator().manual_seed(seed + 4)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=bgen) * B_STD)
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    pm.train()  # dropout 0: train and eval give the same numbers
    pm.save_pretrained(os.path.join(out, "adapter"))

    pm.zero_grad(set_to_none=True)
    logits = pm(input_ids=inputs.long()).logits.float()
    v = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, v), targets.long().reshape(-1))
    loss.backward()
    grads = {}
    for n, p in pm.named_parameters():
        if p.requires_grad:
            grads["grad." + peft_key(n)] = p.grad.detach().clone().contiguous()
    print(f"  loss {loss.item():.7f}, {len(grads)} adapter gradients")

    # the saved adapter's keys are the gradients' keys
    with safe_open(os.path.join(out, "adapter", "adapter_model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    assert saved == {k[len("grad."):] for k in grads}, sorted(saved ^ {k[5:] for k in grads})

    tensors = {"tokens": tokens.contiguous(), "loss": loss.detach().reshape(1).float(),
               "logits": logits.detach().contiguous()}
    tensors.update(grads)
    meta = {"model": f"lora_{name}", "B": str(B), "T": str(T), "lora_r": str(ad["r"]),
            "lora_alpha": repr(float(ad["lora_alpha"])), "lora_targets": ad["flag"],
            "use_rslora": "true" if ad["use_rslora"] else "false", "lora_dropout": "0.0",
            "b_std": repr(B_STD), "torch_version": torch.__version__,
            "transformers_version": transformers.__version__, "peft_version": peft.__version__}
    save_file(tensors, os.path.join(out, "expected.safetensors"), metadata=meta)
    write_shard(os.path.join(out, "tokens.bin"), tokens)

    # a fresh load of base + adapter from disk gives the same loss
    again = peft_loss(out, os.path.join(out, "adapter"), inputs, targets)
    assert abs(again - loss.item()) <= 1e-6 * abs(loss.item()), (again, loss.item())
    with open(os.path.join(out, "adapter", "adapter_config.json")) as f:
        print(f"  adapter_config.json: {json.load(f)}")
    for fn in sorted(os.listdir(out)):
        print(f"  {fn}")


def peft_loss(base_dir, adapter_dir, inputs, targets):
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager",
                                                             dtype=torch.float32)
    moe = getattr(base.config, "model_type", "") == "qwen3_moe"
    if moe:
        import make_moe_fixtures as mm  # noqa: E402
        mm.force_eager_experts(base)
    pm = PeftModel.from_pretrained(base, adapter_dir)
    pm.eval()
    with torch.no_grad():
        if moe:
            return moe_loss(pm, inputs, targets)[0].item()
        return compute_loss(pm, inputs, targets).item()


def check_export(adapter_dir, fixture_dir, expect):
    with safe_open(os.path.join(fixture_dir, "expected.safetensors"), framework="pt") as f:
        tokens = f.get_tensor("tokens")
        ref = f.get_tensor("loss").item()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    got = peft_loss(fixture_dir, adapter_dir, inputs, targets)
    print(f"PEFT loss of {adapter_dir} on {fixture_dir}'s batch: {got:.7f} (the fixture's own "
          f"adapter: {ref:.7f})")
    if expect is not None:
        ok = abs(got - expect) <= 1e-5 * abs(expect)
        print(f"expected {expect:.7f}: {'ok' if ok else 'MISMATCH'}")
        return 0 if ok else 1
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
    ap.add_argument("--out", default=here)
    ap.add_argument("--peft-loss", metavar="ADAPTER_DIR", help="PEFT's loss of this adapter")
    ap.add_argument("--fixture", default="lora_qwen3", help="fixture name or directory")
    ap.add_argument("--expect", type=float, default=None)
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    print(f"torch {torch.__version__}  transformers {transformers.__version__}  peft {peft.__version__}")
    if args.peft_loss:
        fix = args.fixture if os.path.isdir(args.fixture) else os.path.join(args.out, args.fixture)
        sys.exit(check_export(args.peft_loss, fix, args.expect))
    for spec in (qwen3_spec(), llama_spec()):
        make_fixture(spec, args.out)
    make_moe_fixture(args.out)


if __name__ == "__main__":
    main()

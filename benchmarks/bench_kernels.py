"""Microbenchmarks of the MoA Triton kernels against their PyTorch twins and dense SDPA.

    python -m benchmarks.bench_kernels [--dtype bf16] [--quick] [--out benchmarks/results/x.json]

Needs a CUDA GPU: without one it exits with a message and measures nothing (the Triton CPU
interpreter is a correctness tool; its timings mean nothing). `--smoke` runs tiny shapes anywhere
(CPU: under TRITON_INTERPRET=1) to check the script itself; its numbers are not benchmarks.

What is measured (median of triton.testing.do_bench, or CUDA events when unavailable):
* LSA (kernels/lsa.py), per (target shape, token count N):
    - end to end: lsa_rows_from_paged (Triton) vs lsa_attention_reference (twin: torch gather of the
      [N, L, 2*Ekv] rows + the LayerSelfAttention module);
    - stage 1, gather + RMSNorm + qkv projection: lsa_qkv_paged vs torch gather + norm + F.linear,
      with achieved bandwidth (rows read + weights read + qkv written) / time and TFLOP/s;
    - stage 2, attention over layers: lsa_layer_attention vs the twin (RoPE + dense
      F.scaled_dot_product_attention over [N, H, L, e]);
    - stage 3, residual gather-add vs torch gather + add, with achieved bandwidth.
* Tree attention (kernels/tree.py), per (batch, prefix length, tree of 64 nodes): the Triton
  kernel vs the twin (per-sequence gather + masked SDPA) vs dense SDPA alone on K/V already
  gathered into a padded [B, H, T_k, d] tensor (the cost of attention without paging), with the
  achieved KV-read bandwidth.
Every Triton result is also checked against its twin (max abs difference recorded).

Results: JSON with the device, versions and every row, to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _needs_gpu_message() -> str:
    return ("bench_kernels.py: no CUDA GPU found; nothing was measured. The Triton kernels are "
            "benchmarked on a GPU only (run `--smoke` to exercise the script on CPU under the "
            "Triton interpreter; its timings are meaningless).")


def _git_commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def _bench(fn, smoke: bool) -> float:
    """Median milliseconds of fn()."""
    import torch

    if smoke:
        import time

        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except Exception:  # pragma: no cover - old triton
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def _maxdiff(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# LSA
# ---------------------------------------------------------------------------------------------
def bench_lsa(kernels, device, dtype, shapes, token_counts, smoke):
    import torch
    import torch.nn.functional as F

    from vllm_moa.config import TargetSignature
    from vllm_moa.kernels import lsa as lsa_mod
    from vllm_moa.kinds.moa import MoAConfig
    from vllm_moa.kinds.moa.model import LayerSelfAttention

    rows_out = []
    elem = torch.tensor([], dtype=dtype).element_size()
    block_size = 16
    for name, num_layers, kv_heads, head_dim, lsa_heads, inter in shapes:
        sig = TargetSignature("LlamaForCausalLM", num_layers, 4096, 32, kv_heads, head_dim, 32000)
        config = MoAConfig(target=sig, lsa_num_heads=lsa_heads, lsa_intermediate_size=inter)
        torch.manual_seed(0)
        lsa = LayerSelfAttention(config)
        with torch.no_grad():
            for p in lsa.parameters():
                if p.dim() > 1:
                    p.normal_(0, p.shape[1] ** -0.5)
        lsa = lsa.to(device=device, dtype=dtype).eval()
        width = 2 * kv_heads * head_dim
        max_tokens = max(token_counts)
        num_blocks = (max_tokens + block_size - 1) // block_size * 2 + 1  # half the blocks unused
        caches = [torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
                  for _ in range(num_layers)]
        perm = torch.randperm(num_blocks, device=device)
        all_slots = (perm[:, None] * block_size + torch.arange(block_size, device=device)).flatten()
        paged = kernels.PagedLayers.from_caches(caches)
        wqkv = lsa_mod.fused_qkv_weight(lsa)
        for n in token_counts:
            slots = all_slots[:n].contiguous()
            with torch.no_grad():
                got = kernels.lsa_rows_from_paged(lsa, caches, slots)
                want = kernels.lsa_attention_reference(lsa, caches, slots)
                t_triton = _bench(lambda: kernels.lsa_rows_from_paged(lsa, caches, slots), smoke)
                t_twin = _bench(lambda: kernels.lsa_attention_reference(lsa, caches, slots), smoke)

                # stage 1: gather + norm + qkv
                norm_w, eps = lsa.input_norm.weight, lsa.input_norm.eps
                t_qkv = _bench(lambda: lsa_mod.lsa_qkv_paged(paged, slots, norm_w, eps, wqkv), smoke)

                def torch_qkv():
                    rows = kernels.gather_layer_rows(caches, slots).view(-1, width)
                    return F.linear(lsa_mod.rms_norm_reference(rows, norm_w, eps), wqkv)

                t_qkv_twin = _bench(torch_qkv, smoke)
                qkv_bytes = (n * num_layers * width + 3 * width * width + n * num_layers * 3 * width) * elem
                qkv_flops = 2.0 * n * num_layers * width * 3 * width

                # stage 2: attention over layers (kernel vs RoPE + dense SDPA)
                qkv = lsa_mod.lsa_qkv_paged(paged, slots, norm_w, eps, wqkv)
                inv_freq = lsa.rotary.inv_freq
                t_attn = _bench(lambda: lsa_mod.lsa_layer_attention(qkv, num_layers, lsa_heads, inv_freq), smoke)
                t_attn_sdpa = _bench(lambda: lsa_mod.lsa_layer_attention_reference(
                    qkv.view(n, num_layers, 3 * width), lsa_heads, inv_freq), smoke)
                attn_got = lsa_mod.lsa_layer_attention(qkv, num_layers, lsa_heads, inv_freq)
                attn_want = lsa_mod.lsa_layer_attention_reference(qkv.view(n, num_layers, 3 * width).float(),
                                                                  lsa_heads, inv_freq)
                attn_diff = _maxdiff(attn_got.view(n, num_layers, width), attn_want)
                attn_bytes = n * num_layers * 4 * width * elem

                # stage 3: residual gather-add
                h = torch.zeros(n * num_layers, width, device=device, dtype=dtype)
                t_res = _bench(lambda: lsa_mod.lsa_add_rows_paged(h, paged, slots), smoke)
                t_res_twin = _bench(lambda: h + kernels.gather_layer_rows(caches, slots).view(-1, width), smoke)
                res_bytes = 3 * n * num_layers * width * elem
            row = dict(
                kernel="lsa", target=name, num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                lsa_heads=lsa_heads, lsa_intermediate=inter, tokens=n, dtype=str(dtype),
                max_abs_diff_vs_twin=_maxdiff(got, want),
                ms_triton=t_triton, ms_twin=t_twin, speedup=t_twin / t_triton,
                qkv_ms_triton=t_qkv, qkv_ms_twin=t_qkv_twin, qkv_gbps=qkv_bytes / t_qkv / 1e6,
                qkv_tflops=qkv_flops / t_qkv / 1e9,
                layer_attn_ms_triton=t_attn, layer_attn_ms_sdpa=t_attn_sdpa, layer_attn_gbps=attn_bytes / t_attn / 1e6,
                layer_attn_max_abs_diff=attn_diff,
                residual_ms_triton=t_res, residual_ms_twin=t_res_twin, residual_gbps=res_bytes / t_res / 1e6,
                rows_bytes_not_materialised=n * num_layers * width * elem,
            )
            rows_out.append(row)
            print(f"lsa  {name:>10} N={n:5d}: triton {t_triton:8.3f} ms  twin {t_twin:8.3f} ms  "
                  f"x{row['speedup']:.2f}  qkv {row['qkv_gbps']:7.1f} GB/s {row['qkv_tflops']:6.1f} TFLOP/s  "
                  f"diff {row['max_abs_diff_vs_twin']:.2e}", flush=True)
    return rows_out


# ---------------------------------------------------------------------------------------------
# Tree attention
# ---------------------------------------------------------------------------------------------
def _random_tree(n, g):
    import torch

    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return parents


def bench_tree(kernels, device, dtype, configs, smoke):
    import torch
    import torch.nn.functional as F

    rows_out = []
    elem = torch.tensor([], dtype=dtype).element_size()
    block_size = 16
    g = torch.Generator().manual_seed(0)
    for batch, prefix, nodes, heads, kv_heads, head_dim in configs:
        seq = prefix + nodes
        blocks_per_seq = (seq + block_size - 1) // block_size
        num_blocks = batch * blocks_per_seq + 1
        cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
        perm = torch.randperm(num_blocks - 1, generator=g).to(device)
        block_tables = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
        trees = [_random_tree(nodes, g) for _ in range(batch)]
        cu = torch.arange(0, (batch + 1) * nodes, nodes, dtype=torch.int32, device=device)
        masks = kernels.tree_ancestor_masks(torch.tensor(sum(trees, [])), cu.cpu()).to(device)
        prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device=device)
        q = torch.randn(batch * nodes, heads, head_dim, device=device, dtype=dtype)
        args = (q, cache, block_tables, prefix_lens, cu, masks)
        kw = dict(max_tree_nodes=nodes, max_prefix_len=prefix)
        with torch.no_grad():
            got = kernels.tree_attention_triton(*args, **kw)
            want = kernels.tree_attention_reference(*args)
            t_triton = _bench(lambda: kernels.tree_attention_triton(*args, **kw), smoke)
            t_twin = _bench(lambda: kernels.tree_attention_reference(*args), smoke)
            # dense SDPA on pre-gathered K/V (no paging, padded batch) with the same mask
            pos = torch.arange(seq, device=device)
            slots = kernels.slot_mapping(block_tables.long(), pos.expand(batch, seq), block_size)
            k = cache[0][slots // block_size, slots % block_size].transpose(1, 2)  # [B, H_kv, S, d]
            v = cache[1][slots // block_size, slots % block_size].transpose(1, 2)
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
            tree_bits = torch.stack([kernels.tree.ancestor_bits(masks[b * nodes:(b + 1) * nodes], nodes)
                                     for b in range(batch)])
            prefix_ok = torch.ones(batch, nodes, prefix, dtype=torch.bool, device=device)
            mask = torch.cat([prefix_ok, tree_bits], -1)[:, None]
            qd = q.view(batch, nodes, heads, head_dim).transpose(1, 2)
            t_sdpa = _bench(lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask), smoke)
        kv_bytes = 2 * batch * seq * kv_heads * head_dim * elem
        row = dict(kernel="tree_attention", batch=batch, prefix=prefix, tree_nodes=nodes, heads=heads,
                   kv_heads=kv_heads, head_dim=head_dim, dtype=str(dtype),
                   max_abs_diff_vs_twin=_maxdiff(got, want),
                   ms_triton=t_triton, ms_twin=t_twin, ms_dense_sdpa=t_sdpa,
                   speedup_vs_twin=t_twin / t_triton, speedup_vs_dense_sdpa=t_sdpa / t_triton,
                   kv_gbps=kv_bytes / t_triton / 1e6)
        rows_out.append(row)
        print(f"tree B={batch:3d} P={prefix:6d} n={nodes}: triton {t_triton:8.3f} ms  twin {t_twin:8.3f} ms  "
              f"dense SDPA {t_sdpa:8.3f} ms  KV {row['kv_gbps']:7.1f} GB/s  diff {row['max_abs_diff_vs_twin']:.2e}",
              flush=True)
    return rows_out


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device; numbers are not benchmarks")
    parser.add_argument("--only", choices=["lsa", "tree"], action="append", help="run only these")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/...)")
    parser.add_argument("--code-commit", default=None,
                        help="the commit the code is, where it runs without .git (a device copy)")
    args = parser.parse_args(argv)

    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.smoke:
        print(_needs_gpu_message(), file=sys.stderr)
        return 2
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["VLLM_MOA_KERNELS"] = "triton"
    import vllm_moa.kernels as kernels  # the top-level kernels/ folder, installed by setup.py
    if not kernels.HAS_TRITON:
        print("bench_kernels.py: Triton is not installed; nothing was measured.", file=sys.stderr)
        return 2
    import triton

    device = torch.device("cuda" if has_cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    only = set(args.only or ["lsa", "tree"])

    if args.smoke:
        lsa_shapes = [("tiny", 3, 1, 64, 2, 64)]
        lsa_tokens = [1, 5]
        tree_configs = [(2, 20, 5, 4, 2, 64)]
    else:
        # (name, L, H_kv, d, LSA heads, LSA intermediate)
        lsa_shapes = [("llama3-8b", 32, 8, 128, 16, 2048), ("llama3-70b", 80, 8, 128, 16, 2048)]
        lsa_tokens = [1, 16, 128, 1024] if args.quick else [1, 16, 64, 256, 1024, 4096]
        # (batch, prefix, tree nodes, H, H_kv, d)
        tree_configs = [(1, 4096, 64, 32, 8, 128), (8, 2048, 64, 32, 8, 128), (32, 1024, 32, 32, 8, 128)]
        if not args.quick:
            tree_configs += [(1, 32768, 64, 32, 8, 128), (64, 512, 16, 32, 8, 128), (16, 4096, 64, 64, 8, 128)]

    results = []
    if "lsa" in only:
        results += bench_lsa(kernels, device, dtype, lsa_shapes, lsa_tokens, args.smoke)
    if "tree" in only:
        results += bench_tree(kernels, device, dtype, tree_configs, args.smoke)

    info = dict(
        device=torch.cuda.get_device_name(device) if has_cuda else f"cpu ({platform.processor() or 'unknown'}), "
                                                                    "Triton interpreter",
        capability=".".join(map(str, torch.cuda.get_device_capability(device))) if has_cuda else None,
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        python=platform.python_version(), dtype=args.dtype, smoke=args.smoke,
        commit=args.code_commit or _git_commit(),
        timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        timing="triton.testing.do_bench median (ms)" if not args.smoke else "single call (smoke, meaningless)",
    )
    out = args.out
    if out is None:
        tag = "smoke" if args.smoke else torch.cuda.get_device_name(device).replace(" ", "_")
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = ROOT / "benchmarks" / "results" / f"kernels-{tag}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(info=info, results=results), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

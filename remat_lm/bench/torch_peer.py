"""The same GPT-2 in PyTorch eager, next to the JAX figures measured in the same run.

    python -m remat_lm.bench.torch_peer                       # reference shape, 5 timed rounds
    python -m remat_lm.bench.torch_peer --steps 7 --torch_threads 2 --json out/torch_peer.json

Needs the `peer` extra (`pip install -e '.[peer]'`: torch, CPU build); exits 2 without it.

The PyTorch model computes what remat_lm/models/gpt2.py computes (llm.c's GPT-2): pre-LN blocks,
LayerNorm eps 1e-5, `F.scaled_dot_product_attention(is_causal=True)`, tanh GELU, LM head tied to
`wte`, float32; it is loaded with the JAX model's own initial weights (`gpt2.to_llmc`), so both
start from the same loss, which is printed as a check. Rows:
  JAX none / JAX full           remat_lm.bench.policies' settings (saved residuals of the loss, no params)
  PyTorch eager                 no checkpointing
  PyTorch checkpoint per block  `torch.utils.checkpoint(block, x, use_reentrant=False)`
PyTorch is timed at 1 thread and at its default (one per core), and JAX is compared with the faster.
PyTorch's saved bytes come from `torch.autograd.graph.saved_tensors_hooks` during the forward:
unique storages, parameters and the token inputs excluded (as JAX's `intermediates` excludes
arguments). A step is forward + backward (grads set to None first); all four settings are timed
round-robin in one process after one warm-up round (remat_lm.bench.common.interleaved_ms), median reported.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from remat_lm.bench import policies
from remat_lm.bench import common
from remat_lm.bench.common import MiB, Target, fmt, interleaved_ms, machine, markdown_table, median, targets_markdown, cli
from remat_lm.models import gpt2
from remat_lm.argtypes import Parser, int_list, integer

INSTALL_HINT = "remat_lm.bench.torch_peer needs PyTorch (the `peer` extra): pip install -e '.[peer]'"


def torch_gpt2(config: gpt2.GPT2Config, tensors: dict, checkpoint: bool):
    """A PyTorch eager GPT-2 with llm.c's math, weights from `gpt2.to_llmc(config, params)`.

    Example:
      >>> model = torch_gpt2(cfg, gpt2.to_llmc(cfg, params), checkpoint=True)
      >>> loss = model(idx, targets)
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    C, H, L, V = config.n_embd, config.n_head, config.n_layer, config.vocab_size
    t = lambda a: torch.tensor(np.ascontiguousarray(a), dtype=torch.float32)

    class Block(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(C, eps=1e-5), torch.nn.LayerNorm(C, eps=1e-5)
            self.c_attn, self.attn_proj = torch.nn.Linear(C, 3 * C), torch.nn.Linear(C, C)
            self.c_fc, self.mlp_proj = torch.nn.Linear(C, 4 * C), torch.nn.Linear(4 * C, C)
            with torch.no_grad():
                for mod, key in ((self.ln_1, "ln_1"), (self.ln_2, "ln_2"), (self.c_attn, "attn.c_attn"),
                                 (self.attn_proj, "attn.c_proj"), (self.c_fc, "mlp.c_fc"),
                                 (self.mlp_proj, "mlp.c_proj")):
                    mod.weight.copy_(t(tensors[f"{key}.w"][i]))
                    mod.bias.copy_(t(tensors[f"{key}.b"][i]))

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)  # (B, T, C) ×3
            q, k, v = (z.view(B, T, H, C // H).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
            x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = torch.nn.Parameter(t(tensors["wte"])), torch.nn.Parameter(t(tensors["wpe"]))
            self.h = torch.nn.ModuleList(Block(i) for i in range(L))
            self.ln_f = torch.nn.LayerNorm(C, eps=1e-5)
            with torch.no_grad():
                self.ln_f.weight.copy_(t(tensors["ln_f.w"]))
                self.ln_f.bias.copy_(t(tensors["ln_f.b"]))

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = F.embedding(idx, self.wte) + self.wpe[:T]  # (B, T, C)
            for block in self.h:
                x = torch_checkpoint(block, x, use_reentrant=False) if checkpoint else block(x)
            logits = F.linear(self.ln_f(x), self.wte)  # (B, T, Vp)
            if logits.shape[-1] != V:  # llm.c leaves the padded columns out of the softmax
                logits = logits[..., :V]
            return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))

    return GPT()


def torch_saved_bytes(model, idx, targets) -> tuple[int, float]:
    """(bytes of unique storages autograd saves in one forward, the loss); params and inputs excluded."""
    import torch
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    excluded |= {idx.untyped_storage().data_ptr(), targets.untyped_storage().data_ptr()}
    seen = {}

    def pack(x):
        st = x.untyped_storage()
        # NOTE: keyed by storage address: the graph holds every packed tensor until backward, so
        # an address cannot be reused by another storage within one forward.
        if st.data_ptr() not in excluded:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = model(idx, targets)
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return sum(seen.values()), float(loss.detach())


_TORCH_DEFAULT_THREADS = None


def thread_counts(arg: str | None, default: int) -> list[int]:
    """`--torch_threads` → thread counts to time: "1,2" → [1, 2]; None → 1 and PyTorch's default."""
    if arg:
        got = sorted({int(x) for x in str(arg).split(",") if x.strip()})
        if not got or min(got) < 1:
            raise SystemExit(f"--torch_threads={arg!r}: give positive thread counts, e.g. 1,2")
        return got
    return sorted({1, default})


def run(*, n_layer=None, n_embd=None, n_head=None, seq=None, batch=None, vocab=None, steps: int = 5,
        torch_threads=None, log=None) -> dict:
    """Measure JAX none/full and PyTorch eager with/without checkpointing, interleaved in one process.

    PyTorch is timed at every thread count in `torch_threads` (default: 1 and its own default, one
    per core): on a shared 2-core machine its OpenMP threads spin-wait for a descheduled peer, and
    one thread can beat two by 2-3× (docs/BENCHMARKS.md). The targets compare JAX with the fastest.
    Example:
      >>> res = run(n_layer=2, n_embd=32, seq=32, batch=2, steps=2)
      >>> [r["impl"] for r in res["rows"]]
    """
    import torch
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    info = machine()  # date and load average at the start
    global _TORCH_DEFAULT_THREADS
    _TORCH_DEFAULT_THREADS = _TORCH_DEFAULT_THREADS or torch.get_num_threads()  # before any set_num_threads
    threads = thread_counts(",".join(map(str, torch_threads)) if isinstance(torch_threads, (list, tuple))
                            else torch_threads, _TORCH_DEFAULT_THREADS)
    config, seq = policies.build_config("gpt2", "ref", n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                                        seq=seq, vocab=vocab)
    batch = batch or common.REFERENCE_BATCH
    params, idx, targets = policies.inputs(config, batch, seq)
    jax_settings = [s for s in policies.default_settings(config.n_layer) if s.name in ("none", "full")]
    cases = []
    for s in jax_settings:
        log(f"compiling JAX {s.name} ...")
        cases.append(policies.prepare("gpt2", config, s, params, idx, targets))

    tensors = gpt2.to_llmc(config, params)
    t_idx = torch.from_numpy(np.asarray(idx, np.int64))
    t_tgt = torch.from_numpy(np.asarray(targets, np.int64))
    steps_by_name, rows = {f"JAX {c.setting.name}": c.step for c in cases}, []
    for c in cases:
        rows.append(dict(impl=f"JAX {c.setting.name}", framework="jax", remat=c.setting.name != "none",
                         threads=None, saved_bytes=c.saved, loss=c.loss))
    for name, ck in (("PyTorch eager", False), ("PyTorch checkpoint per block", True)):
        model = torch_gpt2(config, tensors, checkpoint=ck)
        saved, loss = torch_saved_bytes(model, t_idx, t_tgt)
        for th in threads:
            impl = name if len(threads) == 1 else f"{name}, {th} thread{'s' if th > 1 else ''}"

            def step(model=model, th=th):
                torch.set_num_threads(th)
                for p in model.parameters():
                    p.grad = None
                model(t_idx, t_tgt).backward()

            steps_by_name[impl] = step
            rows.append(dict(impl=impl, framework="torch", remat=ck, threads=th, saved_bytes=saved, loss=loss))

    log(f"timing {len(steps_by_name)} settings, {steps} interleaved rounds after 1 warm-up ...")
    try:
        times = interleaved_ms(steps_by_name, n=steps, warmup=1)
    finally:
        torch.set_num_threads(_TORCH_DEFAULT_THREADS)
    for r in rows:
        r["step_ms_all"] = times[r["impl"]]
        r["step_ms"] = median(r["step_ms_all"])
    for r in rows:  # time relative to the same framework's no-remat row (same thread count)
        base = next(x for x in rows if x["framework"] == r["framework"] and not x["remat"]
                    and x["threads"] == r["threads"])
        r["time_ratio"] = r["step_ms"] / base["step_ms"]
    meta = dict(info, torch=torch.__version__, torch_threads=threads, seq=seq, batch=batch, steps=steps,
                config={k: v for k, v in dataclasses.asdict(config).items() if k != "recompute"}, command=None)
    return {"meta": meta, "rows": rows, "targets": [dataclasses.asdict(t) for t in evaluate(rows)]}


def evaluate(rows: list[dict]) -> list[Target]:
    """JAX no-remat time ≤ the fastest PyTorch eager's; JAX saved bytes ≤ PyTorch's with and without remat."""
    jn = next(r for r in rows if r["impl"] == "JAX none")
    jf = next(r for r in rows if r["impl"] == "JAX full")
    tn = min((r for r in rows if r["framework"] == "torch" and not r["remat"]), key=lambda r: r["step_ms"])
    tc = next(r for r in rows if r["framework"] == "torch" and r["remat"])

    def saved(name, j, t):
        d = j["saved_bytes"] - t["saved_bytes"]
        # NOTE: at equal activations JAX still keeps two (B, T) arrays PyTorch does not count: the
        # embedding's int32 gather indices (PyTorch saves the token tensor itself, an input, excluded)
        # and the loss's log-sum-exp (PyTorch keeps the log-softmax output instead, same size as
        # JAX's logits); PyTorch keeps a 4-byte total weight. Say by how much, so a miss of a few
        # KiB reads as what it is.
        note = "" if d <= 0 else f"JAX keeps {d:,} bytes more ({100 * d / t['saved_bytes']:.3f}%)"
        return Target(name, f"{j['saved_bytes'] / MiB:.2f} vs {t['saved_bytes'] / MiB:.2f} MiB", d <= 0, note)

    return [
        Target("JAX no-remat step time ≤ PyTorch eager's (its fastest thread count)",
               f"{jn['step_ms']:.0f} vs {tn['step_ms']:.0f} ms ({tn['impl']}; {jn['step_ms'] / tn['step_ms']:.2f}×)",
               jn["step_ms"] <= tn["step_ms"]),
        saved("JAX saved bytes ≤ PyTorch's without remat", jn, tn),
        saved("JAX saved bytes ≤ PyTorch's with remat (full vs checkpoint per block)", jf, tc),
    ]


def report(res: dict) -> str:
    m, c = res["meta"], res["meta"]["config"]
    head = (f"GPT-2 {c['n_layer']} layers, C={c['n_embd']}, {c['n_head']} heads, T={m['seq']}, B={m['batch']}, "
            f"vocab {c['vocab_size']}, float32; median of {m['steps']} interleaved steps after 1 warm-up; "
            f"jax {m['jax']}, torch {m['torch']}, {m['nproc']} CPUs, "
            f"{common.load_note(m)}")
    body = [[r["impl"], fmt(r["saved_bytes"] / MiB, ".1f"), fmt(r["step_ms"], ".0f"), fmt(r["time_ratio"]),
             f"{r['loss']:.5f}"] for r in res["rows"]]
    table = markdown_table(["implementation", "saved MiB", "step ms", "× own no-remat", "initial loss"], body)
    return "\n".join([head, "", table, "", "Targets:", targets_markdown([Target(**t) for t in res["targets"]])])


def main(argv=None) -> int:
    p = Parser(prog="python -m remat_lm.bench.torch_peer", description=__doc__.split("\n\n")[0])
    for k in ("n_layer", "n_embd", "n_head", "seq", "batch", "vocab"):
        p.add_argument(f"--{k}", type=integer(1), default=None, help=f"override {k} of the reference shape")
    p.add_argument("--steps", type=integer(1), default=5, help="timed interleaved rounds (median reported)")
    p.add_argument("--torch_threads", type=int_list(1, example="1,2"), default=None,
                   help="comma-separated PyTorch thread counts to time, e.g. 2 (default: 1 and PyTorch's own)")
    p.add_argument("--json", default=None, help="also write meta, rows and targets here")
    a = p.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    res = run(n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head, seq=a.seq, batch=a.batch, vocab=a.vocab,
              steps=a.steps, torch_threads=a.torch_threads)
    return common.publish(res, report, "remat_lm.bench.torch_peer", argv, a.json)


if __name__ == "__main__":
    sys.exit(cli(main, "torch_peer"))

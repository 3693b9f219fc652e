"""remat.memory: the saved-residuals wrapper (the one place that touches JAX internals) and XLA's report.

The reader tests compile on this host (XLA:CPU, named so): they check that `compiled_memory` and
`compiled_stats` report what XLA's own analysis of the program says, not how much memory remat saves
(that is measured on the GPU/TPU compilers: tests/test_target_peaks.py)."""
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from remat import memory

KEY = jax.random.PRNGKey(0)


def f(w, x):
    h = checkpoint_name(jnp.tanh(x @ w), "qkv")
    return jnp.sum(jnp.sin(h) @ w)


W = jax.random.normal(KEY, (16, 32))
W2 = jax.random.normal(KEY, (32, 16))
X = jax.random.normal(KEY, (4, 16))


def g(w, w2, x):
    h = checkpoint_name(jnp.tanh(x @ w), "qkv")
    return jnp.sum(jnp.sin(h) @ w2)


G = jax.checkpoint(g, policy=jax.checkpoint_policies.save_only_these_names("qkv"))


def test_rows_kinds_names_and_totals_match_jax():
    r = memory.saved_residuals(G, W, W2, X)
    kinds = {row.kind for row in r.rows}
    assert "argument" in kinds and "named" in kinds
    named = [row for row in r.rows if row.kind == "named"]
    assert [(row.name, row.shape, row.dtype, row.bytes) for row in named] == [("qkv", (4, 32), "float32", 512)]
    # the wrapper and JAX's printer agree row for row
    from jax._src.ad_checkpoint import saved_residuals as jax_rows
    ref = jax_rows(G, W, W2, X)
    assert len(ref) == len(r.rows)
    assert r.total == sum(a.size * a.dtype.itemsize for a, _ in ref)
    assert r.intermediates == sum(row.bytes for row in r.rows if row.kind != "argument") < r.total
    assert r["total"] == r.total and r.by_name()["qkv"] == (1, 512)
    assert "qkv" in r.table() and "total" in r.table()


def test_full_checkpoint_keeps_only_arguments():
    r = memory.saved_residuals(jax.checkpoint(g), W, W2, X)
    assert {row.kind for row in r.rows} == {"argument"}
    assert r.intermediates == 0 < memory.saved_residuals(G, W, W2, X).intermediates


def test_compiled_memory_reads_xla_cpu():
    c = memory.compiled_memory(jax.grad(g), W, W2, X)
    assert c.argument == (W.size + W2.size + X.size) * 4
    assert c.output == W.size * 4
    assert c.flops > 2 * 4 * 16 * 32  # at least the first matmul
    assert c.temp > 0  # XLA:CPU's buffers for the backward's intermediates


def test_compiled_stats_reads_an_xla_cpu_programs_analysis():
    compiled = jax.jit(jax.grad(g)).lower(W, W2, X).compile()
    ma = compiled.memory_analysis()
    c = memory.compiled_stats(compiled)
    assert (c.temp, c.argument, c.output, c.alias) == (ma.temp_size_in_bytes, ma.argument_size_in_bytes,
                                                      ma.output_size_in_bytes, ma.alias_size_in_bytes)
    assert c == memory.compiled_memory(jax.grad(g), W, W2, X) and memory.compiled_stats(c) is c


def test_format_bytes_units_and_rounding():
    from remat_lm.argtypes import parse_size
    f = memory.format_bytes
    assert (f(None), f(0), f(1023), f(1024), f(1536 * 2**20), f(3 * 2**30)) == \
        ("n/a", "0 B", "1023 B", "1.0 KiB", "1.50 GiB", "3.00 GiB")
    n = 2**30 + 2**20  # 1.00098 GiB: rounds to 1.00, up to 1.01
    assert (f(n), f(n, up=True)) == ("1.00 GiB", "1.01 GiB")
    for n in (1, 1500, 10**6 + 1, 7 * 2**30 + 3):  # a rounded-up figure, read back as a flag, is still enough
        assert parse_size(f(n, up=True).replace(" ", "")) >= n

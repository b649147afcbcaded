"""Native CPU kernels, built on first use and called through the XLA FFI: ragged paged
attention (``paged_attention.cc``) and the model's matmuls against panel-packed weights
(``linear.cc``; quantized weights in ``linear_quantized.cc``, W8A8's int8 x int8 in
``linear_int8.cc``, 4 bits against int8 activations in ``linear_int4.cc``).

Attention. XLA's CPU backend can only express paged decode attention by gathering every
sequence's K and V into a temporary and running many tiny batched matmuls: at
batch 32 that took about half of a GPT-2-124M decode step. ``paged_attention.cc``
reads K/V straight from the paged cache through the block table, on XLA's own thread
pool (``python experiments/roofline.py`` measures the decode step both ways), for a whole
ragged step at once (:func:`paged_attention`: decode rows and prefill chunks, token-flat,
each block of a chunk's queries reading its context once), so no query is padded to a tile.
It computes the same function as the jnp reference and is tested against it
(``tests/test_native_attention.py``, ``tests/test_native_ragged.py``).

Matmuls. At decode batch sizes XLA's CPU matmuls leave the cores waiting on weights that
stream from memory (and XLA turns a quantized weight into a float copy before its matmul). :func:`linear` multiplies by a weight ``[K, N]`` held as ``[N / W, K, W]`` panels (W = 48,
32 or 16 columns, each panel contiguous; :func:`pack_weight`), which it prefetches
the panels ahead of use (``tests/test_native_linear.py``; ``experiments/roofline.py`` times
the step with and without). Quantized weights (int8, int4 packed two to a byte, or fp8 e4m3,
with scales and optional zero points per column or block and per group of rows, in activation
order or not) are multiplied by :func:`linear_quantized`, which reads the quantized panels and turns them into float32 on
the way; without AVX-512, a step with more rows than :func:`quantized_native_rows` (a long prefill
chunk) has XLA dequantize the panels and run its matmul instead, the faster there. W8A8 (int8 activations per token, int8 weights per column) is an integer matmul,
:func:`linear_int8`, where the library was built with AVX-512 VNNI or AVX2. Symmetric int4 weights
quantized on load run as llama.cpp runs q4_0: :func:`linear_int4` (``linear_int4.cc``) quantizes the
activations to int8 per block of 32 in the kernel and sums integer products on the nibbles
(:func:`pack_int4_blocks`' layout; VNNI, AVX2's ``vpmaddubsw`` or portable loops). The RMS norm is one
operation (:func:`rms_norm`, ``rms_norm.cc``) where XLA's CPU backend makes four; the models use it
where the engine loaded them for these kernels (``ModelConfig.native_norm``). Which weights are stored
this way, and when, is :mod:`paged_jax.weights.panels`' and :func:`paged_jax.weights.prepare`'s
business: this package is the build (:mod:`~paged_jax.native.build`), the FFI calls
(:mod:`~paged_jax.native.attention`, :mod:`~paged_jax.native.linear`) and the C++, and imports
nothing else of paged_jax but :mod:`paged_jax.envs`.

The library is compiled with the system's C++ compiler the first time it is
needed, into ``$PAGED_JAX_HOME/native`` (default ``~/.cache/paged_jax/native``),
keyed by the sources, the compiler flags, jaxlib's version and this CPU; extra flags
come from ``PAGED_JAX_NATIVE_FLAGS``. The attention kernel and the matmuls use AVX-512 (the int8
x int8 one AVX-512 VNNI) where the CPU has it; AVX2 + FMA3 code where it has those instead (the
int8 x int8 matmul ``vpmaddwd``), and portable loops elsewhere (the float32 matmul's are
correct but slower than XLA's matmul); :func:`paths` says which a build compiled in, and
``status()["traced"]`` which kernels ran. When no compiler is found or the build fails,
:func:`available` is False, a warning says why, and everything runs in XLA (plain
weights, jnp decode attention). ``PAGED_JAX_NATIVE=0`` turns the kernels off.
"""

from paged_jax.native.attention import paged_attention, paged_decode
from paged_jax.native.build import (CPU_ISA, INT4_TARGET, INT8_TARGET, KERNELS, LINEAR_TARGET, PANEL_WIDTHS, QUANTIZED_ATTENTION_TARGETS,
                                    QUANTIZED_KERNELS, QUANTIZED_NATIVE_ROWS, QUANTIZED_TARGETS, SUM_TARGET, TARGETS, available, cpu_isa,
                                    loaded, packs_weights, paths, quantized_native_rows, status)
from paged_jax.native.build import _state  # noqa: F401  (the build's record; tests read it)
from paged_jax.native.norm import rms_norm, rms_norm_applies
from paged_jax.native.linear import (linear, linear_int4, linear_int8, linear_quantized, pack_int4_blocks, pack_padded,
                                     pack_weight, panel_width, read_sum, unpack_int4_blocks, unpack_weight)

__all__ = ["available", "loaded", "status", "paths", "cpu_isa", "paged_attention", "paged_decode", "packs_weights",
           "quantized_native_rows", "QUANTIZED_NATIVE_ROWS", "QUANTIZED_KERNELS",
           "panel_width", "pack_weight", "unpack_weight", "pack_padded", "linear", "linear_quantized", "linear_int8",
           "linear_int4", "pack_int4_blocks", "unpack_int4_blocks", "INT4_TARGET",
           "read_sum", "rms_norm", "rms_norm_applies", "CPU_ISA", "KERNELS", "TARGETS", "QUANTIZED_ATTENTION_TARGETS", "LINEAR_TARGET", "SUM_TARGET",
           "QUANTIZED_TARGETS", "INT8_TARGET", "PANEL_WIDTHS"]

"""Weights: the objects that hold a model's matrices, the readers that make them from a
checkpoint, and the one step (:func:`prepare`) that readies them for a platform.

- :mod:`~paged_jax.weights.base`: what a weight class is (a pytree that owns its matmul and
  declares its axes for tensor parallelism), ``linear``, ``map_weights``;
- :mod:`~paged_jax.weights.dense`: ``DenseLinear``, ``DenseEmbedding`` (XLA);
- :mod:`~paged_jax.weights.quantized`: ``QuantizedLinear`` (int8 / int4 / fp8 with scales, zero
  points, activation order; W8A8's activations quantized per token);
- :mod:`~paged_jax.weights.experts`: ``ExpertStack``, a mixture's experts as one weight (any
  class, stacked on an expert axis);
- :mod:`~paged_jax.weights.panels`: the same functions stored for the native CPU matmuls;
- :mod:`~paged_jax.weights.fused`: weights of one input (Q, K, V; gate, up) stored as one panel
  weight, one native call (``project`` reads them, fused or not);
- :mod:`~paged_jax.weights.methods`: one reader per checkpoint method and on-load quantization,
  behind one registry;
- :mod:`~paged_jax.weights.prepare`: quantize on load, then store for the platform's kernels.

A new storage format is one ``@weight_class`` (its ``__call__`` is its matmul); a new checkpoint
method is one file in ``methods/`` and one line in its registry. Model code does not change.
"""

from paged_jax.weights.base import (PARALLEL_ROLES, ROLE_AXIS, WEIGHT_TYPES, is_weight, linear, map_weights,
                                    weight_class)
from paged_jax.weights.dense import DenseEmbedding, DenseLinear
from paged_jax.weights.experts import ExpertStack, stack_experts
from paged_jax.weights.fused import FusedLinear, fuse_inputs, project
from paged_jax.weights.methods import CHECKPOINT_METHODS, QUANTIZE_ON_LOAD, checkpoint_quantization
from paged_jax.weights.panels import PanelEmbedding, PanelInt8Linear, PanelLinear, PanelQuantizedLinear, to_panels
from paged_jax.weights.prepare import prepare
from paged_jax.weights.quantized import ACTIVATION_QUANT, QuantizedLinear, quantize_per_token, rounded_activations

__all__ = ["PARALLEL_ROLES", "ROLE_AXIS", "WEIGHT_TYPES", "is_weight", "linear", "map_weights", "weight_class",
           "DenseEmbedding", "DenseLinear", "ExpertStack", "stack_experts", "FusedLinear", "fuse_inputs", "project",
           "CHECKPOINT_METHODS", "QUANTIZE_ON_LOAD", "checkpoint_quantization",
           "PanelEmbedding", "PanelInt8Linear", "PanelLinear", "PanelQuantizedLinear", "to_panels", "prepare",
           "ACTIVATION_QUANT", "QuantizedLinear", "quantize_per_token", "rounded_activations"]

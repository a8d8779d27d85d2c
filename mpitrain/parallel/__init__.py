"""The framework-neutral core of data-parallel training, below every adapter.

* :mod:`.reducer`: the gradient reducer (averaging as gradients become final, fusion
  batches, compression, ``backward_passes_per_step``) and the optimizer wrapper's base;
* :mod:`.compression`: the gradient compressors (none, fp16, bf16);
* :mod:`.broadcast`: broadcasts of named arrays, of parameter lists and of whole
  structures (optimizer state), and the object collectives;
* :mod:`.pending`: operations in flight as an adapter sees them, and Horovod's integer
  handles;
* :mod:`.refusal`: a local error ends the collective on every rank.

The numpy trainer (:mod:`mpitrain.trainer`), ``mpitrain.torch`` (Horovod's API) and
the ``torch.distributed`` backend (:mod:`mpitrain.torch.distributed`) all build on it;
nothing here knows a framework.
"""

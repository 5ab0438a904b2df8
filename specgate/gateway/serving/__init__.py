"""The models a gateway serves, from config to engine: the model registry
and its lifecycle (models.py: load, unload, leases), residency under the
memory budget (residency.py, footprint.py), a distributed model's share of
this rank (ranks.py), config reload (reloading.py), `specgate tune`
(tuning.py), the builtin model names (builtins.py), what a model is, read
from its checkpoint without loading it (model_card.py), a generation's run
through admission, a policy and an engine (generation.py, stops.py), and
the Prometheus metrics all of it records (metrics.py).

The only room of gateway/ that builds engines; it goes through
engines/registry.py and names no engine itself. May import access/, the
gateway's config.py and errors.py, policies/ and engines/; and builders/,
lazily, in builtins.py alone (the demo's GGUF export). Not api/, cluster/ or
operator/. See docs/DESIGN.md, "Residency and operations".
"""

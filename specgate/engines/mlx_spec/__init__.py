"""Speculative decoding in-process, for every drafting method: the engine
(engine.py: SpecEngine, one sequence at a time on the decode worker), one
sequence's draft-verify-accept rounds (decoder.py: SpecDecoder), and the
acceptance rules as pure functions on arrays (acceptance.py).

A method plugs in as a `Drafting` from engines/drafting/. May import the
rest of engines/ and kernels/. See docs/DESIGN.md, "Engines".
"""

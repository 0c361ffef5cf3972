"""The CPU kernels every part of dspark computes with (the target, the drafters, sampling, training): skinny
products (skinny.*), the fused decoder layers (fused_layers.*), row argmaxes (argmax.*), GGUF weight groups
(groups.py), 4-bit layers (q4_1.py), oneDNN products (onednn.py) and the choice among them (upcast.py). C++ sources
are compiled once per machine into the dspark cache (skinny.py builds them)."""

"""Checkpoint formats: reading configs and safetensors, and building tiny ones."""

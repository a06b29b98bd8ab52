"""Model files: checkpoints (read safely), the transformers and GGUF formats, the weight layouts
they map, and state-dict conversions (MHA -> GQA/MQA)."""

"""The main job behind `qcompress train`: fine-tune a Hugging Face model with compression on the
user's data, evaluate every stage, export, and report (see README, "The main job").

Nothing below `engine/` imports this package; transformers is needed only here and in `hf/`.
"""

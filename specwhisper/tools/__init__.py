"""Command-line tools: the specwhisper CLI, demo, checkpoint fetch and conversion, distillation."""

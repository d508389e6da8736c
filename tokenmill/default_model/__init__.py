"""The embedded default model's chat template (package data: chat_template.jinja)."""

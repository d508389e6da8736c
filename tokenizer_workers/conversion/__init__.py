"""Request conversion, one module per request family around one shared plan step (plan.py).

core.py holds what every kind shares (the model, templates, caches, images); chat.py, completions.py
and token_endpoints.py convert their kinds; tokenizer_workers/converter.py dispatches a job to them.
"""

"""``tokenmill serve``: resolve settings (flag > TOKENMILL_* > --config TOML > default) and run the gateway."""

from __future__ import annotations

from tokenmill import settings as settings_mod

add_arguments = settings_mod.add_arguments


def run(args) -> int:
    from tokenmill.gateway import server

    settings = settings_mod.resolve(args)

    def announce(gw) -> None:
        url = f"http://{settings.host}:{settings.port}"
        print(f"tokenmill is ready at {url}  (model {gw.model_name}, {settings.workers} tokenizer workers)", flush=True)
        print(
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{gw.model_name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}\'',
            flush=True,
        )

    return server.run(settings, on_ready=announce)

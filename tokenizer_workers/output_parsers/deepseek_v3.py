"""deepseek_v3: DeepSeek-V3 (and R1) tool calls, each with its arguments in a fenced JSON block.

    text<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>search
    ```json
    {"query": "q"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The word before ``<｜tool▁sep｜>`` is the call's type (always ``function``); the name runs to
the end of its line; the arguments are the JSON between the fences (pretty-printed JSON too,
which vLLM's one-line pattern misses).
"""

from __future__ import annotations

from tokenmill.tokenizer_workers.output_parsers.base import Piece
from tokenmill.tokenizer_workers.output_parsers.delimited import DelimitedCallsParser

SEP = "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekV3Parser(DelimitedCallsParser):
    name = "deepseek_v3"
    section_start = "<｜tool▁calls▁begin｜>"
    section_end = "<｜tool▁calls▁end｜>"
    call_start = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    markers = (section_start, section_end, call_start, call_end, SEP)
    # the fenced JSON sets it apart from deepseek_v31 (whose signature is the first two)
    template_signature = ("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>", "```json")

    def parse_call(self, body: str, index: int) -> Piece:
        raw = self.call_start + body + self.call_end
        _type, sep, rest = body.partition(SEP)
        name, newline, block = rest.partition("\n")
        block = block.strip()
        if not sep or not newline or not block.startswith(FENCE) or not block.endswith(FENCE) or len(block) < 6:
            return self.call_or_content(None, None, raw)
        _info, _, arguments = block[: -len(FENCE)].partition("\n")  # drop the ```json line and the closing fence
        return self.call_or_content(name, arguments, raw)

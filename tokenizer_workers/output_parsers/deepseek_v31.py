"""deepseek_v31: DeepSeek-V3.1 and the embedded default model's template.

text<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

from tokenmill.tokenizer_workers.output_parsers.base import Piece
from tokenmill.tokenizer_workers.output_parsers.delimited import DelimitedCallsParser

SEP = "<｜tool▁sep｜>"


class DeepSeekV31Parser(DelimitedCallsParser):
    name = "deepseek_v31"
    section_start = "<｜tool▁calls▁begin｜>"
    section_end = "<｜tool▁calls▁end｜>"
    call_start = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    markers = (section_start, section_end, call_start, call_end, SEP)
    template_signature = ("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>")

    def parse_call(self, body: str, index: int) -> Piece:
        name, sep, arguments = body.partition(SEP)
        raw = self.call_start + body + self.call_end
        if not sep:
            return self.call_or_content(None, None, raw)
        return self.call_or_content(name, arguments, raw)

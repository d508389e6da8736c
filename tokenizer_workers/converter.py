"""Request conversion: raw HTTP body in, validated scheduler requests (or a finished answer) out.

This is all the CPU work between an OpenAI request and the GPU scheduler: JSON parsing,
validation, chat-template rendering and tokenization. It runs in tokenizer worker
processes; the benchmark's baseline modes run the very same code on the gateway loop
or in its thread pool. Each request kind is converted in its family's module (conversion/).
"""

from __future__ import annotations

from tokenmill.tokenizer_workers import openai_requests as oa
from tokenmill.tokenizer_workers.chat_template import TemplateError
from tokenmill.tokenizer_workers.conversion import chat, completions, token_endpoints
from tokenmill.tokenizer_workers.conversion.core import ConverterCore
from tokenmill.tokenizer_workers.conversion.plan import Conversion
from tokenmill.tokenizer_workers.messages import ApiError, ConvertDone, ConvertJob

KINDS = {  # ConvertJob.kind -> its conversion
    "chat": chat.convert_chat,
    "responses": chat.convert_responses,
    "messages": chat.convert_messages,
    "completion": completions.convert_completion,
    "count_tokens": token_endpoints.convert_count_tokens,
    "messages_render": token_endpoints.convert_messages_render,
    "responses_render": token_endpoints.convert_responses_render,
    "tokenize": token_endpoints.convert_tokenize,
    "detokenize": token_endpoints.convert_detokenize,
}


class Converter(ConverterCore):
    def convert(self, job: ConvertJob, body: bytes) -> Conversion:
        try:
            return KINDS[job.kind](self, job, body)
        except oa.InvalidRequest as exc:
            return self.error(job, exc.status, exc.message, exc.param, exc.code)
        except TemplateError as exc:
            return self.error(job, 400, f"Chat template error: {exc}", "messages", "chat_template_error")
        except RecursionError:
            return self.error(job, 400, "The request (or its chat template) recursed too deeply.", None, "too_deep")
        except MemoryError:
            return self.error(
                job,
                400,
                "The request (or its chat template) needed more memory than a worker may use.",
                None,
                "too_much_memory",
            )

    def error(self, job: ConvertJob, status: int, message: str, param=None, code=None) -> Conversion:
        kind = "NotFoundError" if status == 404 else "BadRequestError"
        return Conversion(ConvertDone(job.job_id, error=ApiError(status, message, kind, param, code)))

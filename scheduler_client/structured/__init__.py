"""Structured-output specs (protocol 1.1 ``Generate.structured``): the spec model, validation, instances.

Two users, one module each, over a shared model:

* the tokenizer workers validate a spec (:func:`check`, from :mod:`.validate`) and refuse a bad
  one with an HTTP 400 before anything reaches an engine;
* the simulated scheduler writes a text the spec accepts
  (:func:`scheduler_client.structured.generate.example`), after the same validation.

:mod:`.spec` holds what both read (the error, limits, the regex dialect, JSON Schema basics) and
:mod:`.grammar` the grammar dialect's parser. Importing this package loads validation only.
A maintained constrained-decoding library could take over either side behind its one function:
``check(s, where)`` raising :class:`StructuredError`, ``example(s, rng)`` returning a text.

The kinds (``protocol.STRUCTURED_KINDS``):

* ``json_schema``: ``spec`` is a JSON Schema as JSON text (an object, or ``true``);
  references must be local (``#``, ``#/$defs/...``, ``#/definitions/...``, any JSON pointer
  into the document).
* ``json_object``: any JSON object; ``spec`` is ignored.
* ``regex``: Python ``re`` syntax without what constrained-decoding backends cannot do:
  backreferences, lookarounds, conditionals, atomic groups / possessive quantifiers and
  word boundaries are refused. The whole output matches (``re.fullmatch``).
* ``grammar``: the GBNF/xgrammar EBNF dialect: rules ``name ::= expr`` (names of letters,
  digits, ``_``, ``-`` and ``.``; a rule may span lines, a new one starts where ``name ::=``
  appears), double-quoted strings with escapes (``\\n \\t \\r \\\\ \\" \\' \\xHH \\uHHHH
  \\UHHHHHHHH`` ...), character classes ``[a-z]`` / ``[^...]``, rule references, ``( )``,
  ``|``, postfix ``*`` ``+`` ``?`` ``{m}`` ``{m,}`` ``{m,n}`` (one per element), ``#``
  comments, and a lookahead ``(= ...)`` ending a rule. A ``root`` rule is required, every
  referenced rule must be defined, and root must be able to finish. ``.`` and single-quoted
  strings are not part of this dialect and are refused with a hint.
* ``choice``: ``choices`` is a non-empty list of strings; the output is one of them.
* ``structural_tag``: JSON text in vLLM's structural-tag format, either
  ``{"type": "structural_tag", "format": {...}}`` (xgrammar's formats: ``const_string``,
  ``json_schema``, ``any_text``, ``regex``, ``grammar``, ``sequence``, ``or``, ``tag``,
  ``triggered_tags``, ``tags_with_separator``, ``optional``, ``plus``, ``star``, ``repeat``,
  ...) or the older ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``.
  Nested schemas, regexes and grammars are checked like the kinds above.
"""

from scheduler_client.structured.spec import StructuredError
from scheduler_client.structured.validate import check, compile_spec, whitespace_problem

__all__ = ["StructuredError", "check", "compile_spec", "whitespace_problem"]

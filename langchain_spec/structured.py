"""ChatSpeculative.with_structured_output: the model bound to a grammar of the schema, then a parser.

- method="json_schema" (default): the output is constrained to the schema (made strict: no keys the schema
  does not list), so it always parses, unless max_tokens cuts it short;
- method="json_mode": constrained to a JSON object; with a schema, to the schema as well (a local model has
  nothing to gain from an answer its parser then rejects);
- method="function_calling": through bind_tools, the schema as the one tool, which the model must call.

A pydantic class gives instances of it; a TypedDict or a JSON-schema dict gives dicts.

The grammar is built from the schema itself, not from LangChain's function-calling conversion (which drops
`$defs`/`$ref`, so a recursive model's nested objects went unconstrained, and drops unknown keys, so an invalid
`type` became "anything"): a pydantic class gives its own JSON schema, a dict is taken as given (a missing
`title` defaults to "output"), and the result is validated by the code that validates batch lines
(spec_batch.core.structured.response_format): an invalid schema raises InvalidParameterError here. TypedDicts and other
types still go through LangChain's conversion.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Literal

from langchain_core.language_models import LanguageModelInput
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from spec_batch import InvalidParameterError
from spec_batch.core.structured.response_format import parse_response_format

from .schemas import strict_schema

Method = Literal["json_schema", "json_mode", "function_calling"]
METHODS = ("json_schema", "json_mode", "function_calling")
DEFAULT_TITLE = "output"


def structured_output(
    model: Any, schema: Any, *, method: Method, include_raw: bool, strict: bool | None
) -> Runnable[LanguageModelInput, Any]:
    if method not in METHODS:
        raise InvalidParameterError(f"method must be one of {list(METHODS)}, got {method!r}")
    if schema is None and method != "json_mode":
        raise InvalidParameterError(f"with_structured_output(method={method!r}) needs a schema")
    is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    json_schema = schema_of(schema) if schema is not None else None
    ls_format = {"kwargs": {"method": method, "strict": strict}, "schema": traced_schema(schema, json_schema)}
    if method == "function_calling":
        tool = json_schema if isinstance(schema, dict) else schema  # a dict's title defaulted: the tool's name
        tool_name = convert_to_openai_tool(tool)["function"]["name"]
        llm = model.bind_tools([tool], tool_choice=tool_name, ls_structured_output_format=ls_format)
        parser: Runnable = (
            PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
            if is_pydantic
            else JsonOutputKeyToolsParser(key_name=tool_name, first_tool_only=True)
        )
    else:
        response_format = checked(response_format_for(json_schema, strict))
        llm = model.bind(response_format=response_format, ls_structured_output_format=ls_format)
        parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    no_parse = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([no_parse], exception_key="parsing_error")


def traced_schema(schema: Any, own: dict[str, Any] | None) -> dict[str, Any] | None:
    """The schema as LangChain's tracing records it (`ls_structured_output_format`): its own conversion, which
    tracers and the standard tests compare against; the grammar never uses it (module docstring)."""
    if schema is None:
        return None
    try:
        return convert_to_json_schema(schema)
    except (TypeError, ValueError, KeyError):  # a schema LangChain cannot convert: trace the one we decode with
        return own


def schema_of(schema: Any) -> dict[str, Any]:
    """The JSON schema of what with_structured_output was given (module docstring)."""
    if isinstance(schema, type) and is_basemodel_subclass(schema):
        own = getattr(schema, "model_json_schema", None)  # pydantic 2; pydantic 1 models have .schema()
        out = own() if own is not None else schema.schema()
        return out if "title" in out else {"title": schema.__name__, **out}  # a recursive model's root is a $ref
    if isinstance(schema, dict):
        if isinstance(schema.get("function"), dict):  # an OpenAI tool: {"type": "function", "function": {...}}
            schema = schema["function"]
        if "parameters" in schema and "name" in schema:  # an OpenAI function: its parameters are the schema
            return {"title": schema["name"], **schema["parameters"]}
        return schema if "title" in schema else {"title": DEFAULT_TITLE, **schema}
    return convert_to_json_schema(schema)


def checked(response_format: dict[str, Any]) -> dict[str, Any]:
    """response_format validated by the batch lines' own code; InvalidParameterError naming the problem."""
    try:
        parse_response_format(response_format)
    except InvalidParameterError as exc:
        raise InvalidParameterError(f"with_structured_output: the schema is not usable: {exc}") from None
    return response_format


def response_format_for(json_schema: dict[str, Any] | None, strict: bool | None) -> dict[str, Any]:
    """The response_format of a schema (strict unless strict=False); any JSON object without one."""
    if json_schema is None:
        return {"type": "json_object"}
    schema = json_schema if strict is False else strict_schema(json_schema)
    name = str(json_schema.get("title") or DEFAULT_TITLE)
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict is not False}}

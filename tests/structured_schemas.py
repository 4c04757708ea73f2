"""Ten JSON schemas for the structured-output tests: nested objects, arrays, enums, numbers with
bounds, required and optional fields. Strings and arrays are bounded so a 135M model at
temperature 0.7 finishes every document well inside ``max_tokens``."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {
        "name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}),
    ("a product", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "in_stock": {"type": "boolean"}},
        "required": ["id", "price", "in_stock"]}),
    ("a colour", {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("a user with an address", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": NAME,
            "address": {"type": "object", "properties": {
                "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
            "required": ["name", "address"]}},
        "required": ["user"]}),
    ("a few digits", {"type": "object", "properties": {
        "numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 1, "maxItems": 5}},
        "required": ["numbers"]}),
    ("a book", {"type": "object", "properties": {
        "title": NAME, "subtitle": NAME,
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["title"]}),
    ("a shopping list", {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {
                "name": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["name", "qty"]}}},
        "required": ["items"]}),
    ("a review", {"type": "object", "properties": {
        "rating": {"enum": [1, 2, 3, 4, 5]}, "recommend": {"type": "boolean"}},
        "required": ["rating", "recommend"]}),
    ("a weather report", {"type": "object", "properties": {
        "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
        "unit": {"enum": ["C", "F"]}},
        "required": ["temperature", "unit"]}),
    ("an answer", {"type": "object", "properties": {
        "answer": {"anyOf": [NAME, {"type": "null"}]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["answer"]}),
]


def prompt_for(what: str) -> str:
    return f"Reply with {what} as a JSON object."

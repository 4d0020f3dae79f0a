"""Ten output schemas (pydantic models, as clients write them) for the structured-output tests and benchmark:
nested objects, bounded arrays, enums, numbers with ranges, optional fields, $defs/$ref. Strings and arrays are
bounded so a sampled answer always fits its max_tokens."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel as _Base
from pydantic import ConfigDict, Field


class BaseModel(_Base):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict clients send


Short = Annotated[str, Field(min_length=1, max_length=24)]


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: Short
    country: Short
    population: Annotated[int, Field(ge=0, le=50_000_000)]


class Person(BaseModel):
    name: Short
    age: Annotated[int, Field(ge=0, le=120)]


class Address(BaseModel):
    street: Short
    zip_code: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Employee(BaseModel):  # nested object through $defs/$ref
    person: Person
    address: Address


class Inventory(BaseModel):  # array of objects with bounds
    items: Annotated[list[City], Field(min_length=1, max_length=3)]


class Palette(BaseModel):  # enums, bounded array of enums
    favorite: Color
    others: Annotated[list[Color], Field(max_length=3)]


class Measurement(BaseModel):  # numbers with ranges
    celsius: Annotated[int, Field(ge=-50, le=60)]
    humidity: Annotated[int, Field(ge=0, le=100)]
    ok: bool


class Profile(BaseModel):  # optional fields
    username: Short
    nickname: Short | None = None
    score: Annotated[int, Field(ge=0, le=1000)] | None = None


class Answer(BaseModel):  # literal choice + boolean
    verdict: Literal["yes", "no", "maybe"]
    confident: bool


class Team(BaseModel):  # $ref reused twice, array bounds
    lead: Person
    members: Annotated[list[Person], Field(min_length=1, max_length=2)]


class Book(BaseModel):
    title: Short
    year: Annotated[int, Field(ge=1450, le=2030)]
    tags: Annotated[list[Short], Field(max_length=2)]


MODELS: list[type[_Base]] = [City, Employee, Inventory, Palette, Measurement, Profile, Answer, Team, Book,
                                 Person]
PROMPTS = ["Describe a city.", "Invent an employee.", "List a few cities.", "Pick some colors.",
           "Report the weather.", "Make a user profile.", "Is the sky blue?", "Describe a small team.",
           "Recommend a book.", "Invent a person."]

"""Summarizers: ``extractive`` (default, no network), ``openai`` and ``ollama`` over httpx.

Chosen by name from a profile through the one registry in ``registry``.
"""

from contextsvc.summarizers.extractive import ExtractiveSummarizer
from contextsvc.summarizers.ollama import OllamaSummarizer
from contextsvc.summarizers.openai import OpenAISummarizer
from contextsvc.summarizers.registry import SUMMARIZERS, SummarizerFactory, SummarizerSet, build_summarizers

__all__ = [
    "SUMMARIZERS",
    "ExtractiveSummarizer",
    "OllamaSummarizer",
    "OpenAISummarizer",
    "SummarizerFactory",
    "SummarizerSet",
    "build_summarizers",
]

"""Agents written with Pydantic AI, the OpenAI Agents SDK or LangGraph, run as agent runs."""

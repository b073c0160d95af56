"""Agents written with Pydantic AI, the OpenAI Agents SDK or LangGraph, run durably as agent runs."""

"""The `agent` workflow: episodes played by agents of their own through an OpenAI-compatible gateway that the rollout
worker serves (docs/agents.md). `chat.py` is the API's shapes, `sessions.py` the sessions (plain Python),
`workflow.py` the rollout workflow, `server.py` the HTTP face (FastAPI)."""

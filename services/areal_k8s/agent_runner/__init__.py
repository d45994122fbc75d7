"""The agent runner: claims the `agent` workflow's episodes from the rollout workers' gateways and plays each with
the user's own program (`agents.command`), which talks to its session through any OpenAI client (docs/agents.md)."""

"""The base of every job-file section: unknown keys are errors, and so are invalid assignments."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

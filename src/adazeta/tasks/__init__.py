"""Tasks: specs (data sources and templates), render hooks and flatteners, loaders, objectives, metrics, and the
in-context demonstrations (``demonstrations``) prepended to prompts."""

# Importing the built-in render hooks (COPA, ReCoRD, SQuAD, DROP) and flatteners registers them, so that every
# import of a task module finds them; here rather than in ``spec``, which ``hooks`` imports.
from adazeta.tasks import hooks  # noqa: F401

"""SPLASH: serve MLA models and switch the attention layout while requests keep running."""

from splash.errors import SplashError
from splash.outputs import RequestOutput
from splash.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SplashError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # lazy: `import splash` stays light (no torch) for clients
        from splash.llm import LLM

        return LLM
    raise AttributeError(name)

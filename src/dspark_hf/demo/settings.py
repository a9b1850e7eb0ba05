"""The demo's controls: the caps a running demo enforces, the settings of one request, and the policy string
they make."""

from __future__ import annotations

from dataclasses import dataclass

#: UI label → policy name understood by [`resolve_policy`][dspark_hf.scheduling.policies.resolve_policy].
POLICIES = {
    "fixed": "fixed",
    "threshold": "threshold",
    "hardware-aware": "hardware_aware",
    "hardware-aware lagged": "hardware_aware_lagged",
}


@dataclass
class Caps:
    """Safety limits of a running demo.

    Args:
        max_prompt_tokens (`int`, *optional*, defaults to 1024): longest templated conversation accepted.
        max_new_tokens (`int`, *optional*, defaults to 256): upper bound of the "max new tokens" control.
    """

    max_prompt_tokens: int = 1024
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"Caps must be >= 1, got max_prompt_tokens={self.max_prompt_tokens}, "
                f"max_new_tokens={self.max_new_tokens}."
            )


@dataclass
class Settings:
    """The controls of one request.

    Args:
        temperature (`float`): 0 means greedy.
        max_new_tokens (`int`): tokens to generate at most.
        policy (`str`): a key of [`POLICIES`].
        gamma (`int`): drafted tokens the policy may consider (at most the draft's block size); for the
            fixed policy, the number verified every round.
        threshold (`float`): survival threshold of the threshold policy.
        background_tokens (`int`): tokens of other requests assumed to share each verification forward
            (hardware-aware policies).
        seed (`int`, *optional*, defaults to 0): torch seed set before each generation (sampling).
    """

    temperature: float = 0.0
    max_new_tokens: int = 64
    policy: str = "hardware-aware"
    gamma: int = 7
    threshold: float = 0.3
    background_tokens: int = 0
    seed: int = 0


def policy_string(settings: Settings) -> str:
    """The policy string of the controls: `fixed:N`, `threshold:T`, `hardware_aware:BG` or `hardware_aware_lagged:BG`."""
    if settings.policy not in POLICIES:
        raise ValueError(f"Unknown policy {settings.policy!r}; choose one of {', '.join(POLICIES)}.")
    name = POLICIES[settings.policy]
    if name == "fixed":
        return f"fixed:{int(settings.gamma)}"
    if name == "threshold":
        return f"threshold:{float(settings.threshold):g}"
    return f"{name}:{int(settings.background_tokens)}"


def check_request(settings: Settings, prompt_tokens: int, caps: Caps, block_size: int) -> str | None:
    """`None` if the request is within the caps, else a message saying what was asked and what is allowed."""
    if prompt_tokens > caps.max_prompt_tokens:
        return (
            f"The conversation is {prompt_tokens} tokens long; this demo accepts at most {caps.max_prompt_tokens} "
            "prompt tokens. Clear the chat or send a shorter message."
        )
    if not 1 <= settings.max_new_tokens <= caps.max_new_tokens:
        return f"max new tokens must be between 1 and {caps.max_new_tokens}, got {settings.max_new_tokens}."
    if not 1 <= settings.gamma <= block_size:
        return f"γ must be between 1 and the draft's block size {block_size}, got {settings.gamma}."
    if settings.temperature < 0:
        return f"temperature must be >= 0 (0 = greedy), got {settings.temperature}."
    if not 0.0 <= settings.threshold <= 1.0:
        return f"threshold must be between 0 and 1, got {settings.threshold}."
    if settings.background_tokens < 0:
        return f"background load must be >= 0 tokens, got {settings.background_tokens}."
    return None

"""What the front and a replica say to each other, typed (one module, shared by both ends): the
request a replica runs, and the frames on its stdin/stdout. No torch, no pydantic: the front and the
replica both import it.
"""

from __future__ import annotations

# A temperature at or under this samples greedily (vLLM's _SAMPLING_EPS). A positive temperature as small
# as 1e-39 is a valid float, but logits / 1e-39 overflow to inf and softmax gives NaN: such a request is
# answered as greedy (the limit of sampling as temperature goes to 0), never lost.
GREEDY_BELOW = 1e-5

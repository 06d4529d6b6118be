"""Request flows: how an admitted request is placed on engines and its answer relayed.

``call`` holds the per-request record every flow shares; ``relay`` the SSE and JSON relays and
usage capture; ``collocated`` the flow for engines that prefill and decode (dispatch, retries
before the first byte, timeouts). Disaggregated and migrating flows go beside it.
"""

"""The LLM side of the agent: one module builds the client (`client`), one defines what the
model may propose and turns it into candidates (`proposals`), one renders the prompts from the
template files in `prompts/` (`prompting`)."""

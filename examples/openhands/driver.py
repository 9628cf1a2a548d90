"""Run the OpenHands SDK agent on one task, headless (in the OpenHands venv, Python >= 3.12).

    python driver.py BASE_URL MODEL WORKSPACE MAX_STEPS TASK

The agent gets OpenHands' own terminal and file editor tools in WORKSPACE and at
most MAX_STEPS iterations. Only the SDK is imported here, never lightning_lite:
this runs in another venv. Exit code 0 when the conversation ran to its end
(finished or out of steps); anything else (an API error) is a crash.
"""

import sys

from openhands.sdk import LLM, Agent, Conversation, Tool
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.terminal import TerminalTool
from pydantic import SecretStr

base_url, model, workspace, max_steps, task = (
    sys.argv[1],
    sys.argv[2],
    sys.argv[3],
    int(sys.argv[4]),
    sys.argv[5],
)
# "openai/<name>": litellm's OpenAI-compatible route (a gpt-5-like name would switch to the Responses API).
# num_retries=0: a retry would be a second, differently sampled call of the same turn.
# timeout=None: the SDK's default 300 s per call is too short for a 6.5k-token prompt on a busy CPU;
# the trainer's --rollout-timeout bounds the whole rollout anyway.
llm = LLM(
    model=f"openai/{model}",
    base_url=base_url,
    api_key=SecretStr("x"),
    usage_id="agent",
    stream=False,
    num_retries=0,
    timeout=None,
)
# The subprocess terminal, not tmux: a tmux server is shared and outlives the rollout.
tools = [
    Tool(name=TerminalTool.name, params={"terminal_type": "subprocess"}),
    Tool(name=FileEditorTool.name),
]
conv = Conversation(
    agent=Agent(llm=llm, tools=tools),
    workspace=workspace,
    max_iteration_per_run=max_steps,
    visualizer=None,
)
try:
    conv.send_message(task)
    conv.run()
    print("status:", conv.state.execution_status)
finally:
    conv.close()  # stops the terminal session

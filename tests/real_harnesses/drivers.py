"""Small headless drivers for the harnesses that are Python libraries, not programs.

Each runs in that harness's own venv (.harnesses/<name>-venv), against an
OpenAI-compatible base URL, with one shell tool, for one task:

    python drivers.py HARNESS BASE_URL TASK WORKDIR

HARNESS: openhands | agents-responses | agents-chat | smolagents | langgraph.
Only the harness's own packages are imported here (not lightning_lite).
"""

import subprocess
import sys


def sh(command: str, cwd: str) -> str:
    """The shell tool the library harnesses get: run a command, return its output."""
    p = subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=60)
    return (p.stdout + p.stderr)[-4000:] or f"(exit code {p.returncode}, no output)"


def openhands(base_url, task, workdir):
    from openhands.sdk import LLM, Agent, Conversation, Tool
    from openhands.tools.file_editor import FileEditorTool
    from openhands.tools.terminal import TerminalTool
    from pydantic import SecretStr

    # A neutral model name: gpt-5-like names switch the SDK to the Responses API.
    llm = LLM(
        model="openai/smollm2",
        base_url=base_url,
        api_key=SecretStr("x"),
        usage_id="agent",
        stream=False,
        num_retries=0,
    )
    agent = Agent(llm=llm, tools=[Tool(name=TerminalTool.name), Tool(name=FileEditorTool.name)])
    conv = Conversation(agent=agent, workspace=workdir, max_iteration_per_run=4, visualizer=None)
    conv.send_message(task)
    conv.run()
    print("status:", conv.state.execution_status)


def agents(base_url, task, workdir, api):
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace upload to api.openai.com

    @function_tool
    def bash(command: str) -> str:
        """Run a bash command and return its output."""
        return sh(command, workdir)

    client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    model = (OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)(
        model="smollm2", openai_client=client
    )
    agent = Agent(
        name="assistant",
        instructions="You are a helpful assistant with a bash tool.",
        tools=[bash],
        model=model,
    )
    from agents.exceptions import MaxTurnsExceeded

    try:
        print("final:", Runner.run_sync(agent, task, max_turns=4).final_output)
    except MaxTurnsExceeded as e:  # the model did not finish: a task failure, not a protocol error
        print("turn limit:", e)


def smolagents(base_url, task, workdir):
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def bash(command: str) -> str:
        """Run a bash command and return its output.

        Args:
            command: the command line to run.
        """
        return sh(command, workdir)

    model = OpenAIServerModel(
        model_id="smollm2", api_base=base_url, api_key="x", client_kwargs={"max_retries": 0}
    )
    agent = ToolCallingAgent(tools=[bash], model=model, max_steps=3, verbosity_level=1)
    print("final:", agent.run(task))


def langgraph(base_url, task, workdir):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def bash(command: str) -> str:
        """Run a bash command and return its output."""
        return sh(command, workdir)

    llm = ChatOpenAI(model="smollm2", base_url=base_url, api_key="x", max_retries=0)
    graph = create_react_agent(llm, [bash])
    from langgraph.errors import GraphRecursionError

    try:
        out = graph.invoke({"messages": [("user", task)]}, {"recursion_limit": 8})
        print("final:", out["messages"][-1].content)
    except (
        GraphRecursionError
    ) as e:  # the model did not finish: a task failure, not a protocol error
        print("step limit:", e)


if __name__ == "__main__":
    name, base_url, task, workdir = sys.argv[1:5]
    if name.startswith("agents-"):
        agents(base_url, task, workdir, name.split("-", 1)[1])
    else:
        {"openhands": openhands, "smolagents": smolagents, "langgraph": langgraph}[name](
            base_url, task, workdir
        )

from mmtrace.agent.cli import main

main()

"""Tools for the chat: MCP servers the app starts and the calls the model makes."""

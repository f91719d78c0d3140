/*
 * airflow-arroyo: forgets, from the JVM's delete-on-exit list, the Unix domain socket files Spark has already
 * deleted. Spark 4.1+ registers the socket file of every transfer to Python with File.deleteOnExit() and deletes
 * the file itself when the transfer ends; the JDK keeps each path until the JVM exits (docs/runtime.md, "The
 * JVM's delete-on-exit list"). airflow_arroyo.jvm.SocketPathPruner calls it from a pipeline's driver, and
 * SocketPathsPlugin from each executor of a standalone cluster.
 */
package airflow.arroyo.spark;

import java.io.File;
import java.lang.reflect.Field;
import java.util.Iterator;
import java.util.Set;
import java.util.function.Function;
import java.util.regex.Pattern;

public final class SocketPaths {
  /** The name Spark gives a socket file: "." + a random UUID + ".sock". */
  private static final Pattern SPARK_SOCKET =
      Pattern.compile("\\.[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\\.sock");

  private SocketPaths() {}

  /**
   * {@link #forgetDeletedIn} on the JVM's delete-on-exit list, under the list's own lock (the one
   * File.deleteOnExit() takes).
   *
   * @return how many paths were dropped (0 once the JVM is shutting down)
   */
  public static int forgetDeleted(int keepNewest) throws ReflectiveOperationException {
    return withList(files -> files == null ? 0 : forgetDeletedIn(files, keepNewest));
  }

  /**
   * Drops from {@code files} (in the order of registration, oldest first) the paths of Spark's socket files that
   * no longer exist, leaving the newest {@code keepNewest} entries alone (Spark registers a path just before it
   * binds the socket) and every other path. The caller holds the set's lock.
   *
   * @return how many paths were dropped
   */
  public static int forgetDeletedIn(Set<String> files, int keepNewest) {
    int candidates = files.size() - Math.max(0, keepNewest);
    int dropped = 0;
    Iterator<String> it = files.iterator();
    for (int i = 0; i < candidates && it.hasNext(); i++) {
      File file = new File(it.next());
      if (SPARK_SOCKET.matcher(file.getName()).matches() && !file.exists()) {
        it.remove();
        dropped++;
      }
    }
    return dropped;
  }

  /** How many paths the delete-on-exit list holds (-1 once the JVM is shutting down). */
  public static int registered() throws ReflectiveOperationException {
    return withList(files -> files == null ? -1 : files.size());
  }

  /** Whether the delete-on-exit list holds {@code path}. */
  public static boolean isRegistered(String path) throws ReflectiveOperationException {
    return withList(files -> files != null && files.contains(path));
  }

  /**
   * {@code action} on the JVM's delete-on-exit list (null once the JVM is shutting down), under the list's own
   * lock. Needs java.base/java.io opened to this class's module (Spark's launcher opens it: --add-opens).
   */
  @SuppressWarnings("unchecked")
  private static <T> T withList(Function<Set<String>, T> action) throws ReflectiveOperationException {
    Class<?> hook = Class.forName("java.io.DeleteOnExitHook");
    Field field = hook.getDeclaredField("files");
    field.setAccessible(true);
    synchronized (hook) {
      return action.apply((Set<String>) field.get(null));
    }
  }
}

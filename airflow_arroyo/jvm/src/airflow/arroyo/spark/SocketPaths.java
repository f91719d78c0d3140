/*
 * airflow-arroyo: forgets, from the JVM's delete-on-exit list, the Unix domain socket files Spark has already
 * deleted (airflow_arroyo.jvm.SocketPathPruner calls it from a pipeline's driver).
 *
 * With spark.python.unix.domain.socket.enabled (Spark 4.1+), every transfer between the JVM and Python (a
 * DataFrame's toArrow() or collect(), a Python worker's start) binds a socket file named ".<uuid>.sock",
 * registers it with File.deleteOnExit() and deletes it itself when the transfer ends. The JDK keeps every
 * registered path until the JVM exits: ~150 bytes of heap per transfer, without bound in a driver that runs
 * for months.
 */
package airflow.arroyo.spark;

import java.io.File;
import java.lang.reflect.Field;
import java.util.Iterator;
import java.util.Set;
import java.util.regex.Pattern;

public final class SocketPaths {
  /** The name Spark gives a socket file: "." + a random UUID + ".sock". */
  private static final Pattern SPARK_SOCKET =
      Pattern.compile("\\.[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\\.sock");

  private SocketPaths() {}

  /**
   * Drops from the delete-on-exit list the paths of Spark's socket files that no longer exist, leaving the
   * newest {@code keepNewest} entries alone (Spark registers a path just before it binds the socket there).
   * Other paths are never touched. Runs under the list's own lock (the one File.deleteOnExit() takes).
   *
   * @return how many paths were dropped (0 once the JVM is shutting down)
   */
  public static int forgetDeleted(int keepNewest) throws ReflectiveOperationException {
    Class<?> hook = hookClass();
    Field field = filesField(hook);
    synchronized (hook) {
      Set<String> files = files(field);
      if (files == null) {
        return 0;
      }
      int candidates = files.size() - Math.max(0, keepNewest);
      int dropped = 0;
      Iterator<String> it = files.iterator();  // oldest first: the list keeps the order of registration
      for (int i = 0; i < candidates && it.hasNext(); i++) {
        File file = new File(it.next());
        if (SPARK_SOCKET.matcher(file.getName()).matches() && !file.exists()) {
          it.remove();
          dropped++;
        }
      }
      return dropped;
    }
  }

  /** How many paths the delete-on-exit list holds (-1 once the JVM is shutting down). */
  public static int registered() throws ReflectiveOperationException {
    Class<?> hook = hookClass();
    Field field = filesField(hook);
    synchronized (hook) {
      Set<String> files = files(field);
      return files == null ? -1 : files.size();
    }
  }

  /** Whether the delete-on-exit list holds {@code path}. */
  public static boolean isRegistered(String path) throws ReflectiveOperationException {
    Class<?> hook = hookClass();
    Field field = filesField(hook);
    synchronized (hook) {
      Set<String> files = files(field);
      return files != null && files.contains(path);
    }
  }

  private static Class<?> hookClass() throws ClassNotFoundException {
    return Class.forName("java.io.DeleteOnExitHook");
  }

  /** Needs java.base/java.io opened to this class's module (Spark's launcher opens it: --add-opens). */
  private static Field filesField(Class<?> hook) throws NoSuchFieldException {
    Field field = hook.getDeclaredField("files");
    field.setAccessible(true);
    return field;
  }

  @SuppressWarnings("unchecked")
  private static Set<String> files(Field field) throws IllegalAccessException {
    return (Set<String>) field.get(null);
  }
}
